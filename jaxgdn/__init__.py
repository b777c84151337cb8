"""jaxgdn: a JAX/Pallas inference engine for Qwen3.5 (Gated DeltaNet + gated attention + MTP)."""

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import ConfigError, ModelConfig, qwen35_0_8b

__all__ = ["CheckpointError", "ConfigError", "ModelConfig", "load_checkpoint", "qwen35_0_8b", "save_checkpoint"]
