"""jaxgdn: a JAX/Pallas inference engine for Qwen3.5 (Gated DeltaNet + gated attention + MTP)."""

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import ConfigError, ModelConfig, qwen35_0_8b
from .engine_config import EngineConfig
from .llm import LLM
from .request import RequestOutput, SamplingParams

__all__ = [
    "CheckpointError", "ConfigError", "EngineConfig", "LLM", "ModelConfig", "RequestOutput", "SamplingParams",
    "load_checkpoint", "qwen35_0_8b", "save_checkpoint",
]
