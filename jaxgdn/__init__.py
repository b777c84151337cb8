"""jaxgdn: a JAX/Pallas inference engine for Qwen3.5 (Gated DeltaNet + gated attention + MTP)."""

import logging

_logger = logging.getLogger("jaxgdn")
if not _logger.handlers:  # start-up lines (programs compiled, memory planned) reach users by default
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s jaxgdn: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)

from .engine.config import EngineConfig
from .engine.llm_engine import LLMEngine
from .engine.request import RequestOutput, SamplingParams
from .engine.structured import StructuredOutputsParams
from .llm import LLM
from .model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .model.config import ConfigError, ModelConfig, qwen35_0_8b

__all__ = [
    "CheckpointError", "ConfigError", "EngineConfig", "LLM", "LLMEngine", "ModelConfig", "RequestOutput", "SamplingParams",
    "StructuredOutputsParams",
    "load_checkpoint", "qwen35_0_8b", "save_checkpoint",
]
