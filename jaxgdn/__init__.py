"""jaxgdn: a JAX/Pallas inference engine for Qwen3.5 (Gated DeltaNet + gated attention + MTP)."""

import logging

_logger = logging.getLogger("jaxgdn")
if not _logger.handlers:  # start-up lines (programs compiled, memory planned) reach users by default
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s jaxgdn: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import ConfigError, ModelConfig, qwen35_0_8b
from .engine_config import EngineConfig
from .llm import LLM
from .request import RequestOutput, SamplingParams

__all__ = [
    "CheckpointError", "ConfigError", "EngineConfig", "LLM", "ModelConfig", "RequestOutput", "SamplingParams",
    "load_checkpoint", "qwen35_0_8b", "save_checkpoint",
]
