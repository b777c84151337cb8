"""jaxgdn: a JAX/Pallas inference engine for Qwen3.5 (Gated DeltaNet + gated attention + MTP)."""

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import ConfigError, ModelConfig, qwen35_0_8b

__all__ = ["CheckpointError", "ConfigError", "ModelConfig", "load_checkpoint", "qwen35_0_8b", "save_checkpoint"]
from .engine_config import EngineConfig  # noqa: E402
from .llm import LLM  # noqa: E402
from .request import RequestOutput, SamplingParams  # noqa: E402

__all__ += ["EngineConfig", "LLM", "RequestOutput", "SamplingParams"]
