"""Model configuration: parsed from a Hugging Face `config.json`, hashable so it is static under jit.

Rules (docs/qwen35-architecture.md §1): read `text_config` if present, else the top level;
rope fields come from `rope_parameters` first, then legacy top-level keys; `layer_types` wins over
`full_attention_interval`; the tie flag is read from `text_config`, else the top level.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
KNOWN_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


class ConfigError(ValueError):
    """A config.json that jaxgdn cannot use; the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Qwen3.5 text model + MTP head. Frozen (hashable): pass it as a static argument to jit."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = (11, 11, 10)
    mrope_interleaved: bool = True
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = True
    mtp_num_hidden_layers: int = 1
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    model_type: str = "qwen3_5_text"

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        if bad:
            raise ConfigError(f"unknown layer type(s) {bad}; expected {FULL_ATTENTION!r} or {LINEAR_ATTENTION!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary dim {self.rotary_dim} must be even and <= head_dim {self.head_dim}")

    # Derived sizes (symbols of the reference: Kd, Vd, C, R).
    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def has_mtp(self) -> bool:
        return self.mtp_num_hidden_layers > 0

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- HF config.json <-> ModelConfig
    @classmethod
    def from_hf_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        """Parse a Hugging Face config dict (`qwen3_5` with `text_config`, or flat `qwen3_5_text`)."""
        model_type = raw.get("model_type")
        if model_type not in KNOWN_MODEL_TYPES:
            raise ConfigError(
                f"{source}: unknown model_type {model_type!r}; jaxgdn serves {', '.join(KNOWN_MODEL_TYPES)}"
            )
        text = raw.get("text_config") or raw

        def need(key: str):
            if key not in text:
                raise ConfigError(f"{source}: missing required key {key!r}")
            return text[key]

        num_layers = int(need("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
            ]
        rope = dict(text.get("rope_parameters") or raw.get("rope_parameters") or {})
        legacy_scaling = text.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", text.get("rope_theta", legacy_scaling.get("rope_theta", 1e7)))
        prf = rope.get(
            "partial_rotary_factor",
            text.get("partial_rotary_factor", legacy_scaling.get("partial_rotary_factor", 0.25)),
        )
        mrope_section = rope.get("mrope_section", legacy_scaling.get("mrope_section", [11, 11, 10]))
        mrope_interleaved = rope.get("mrope_interleaved", legacy_scaling.get("mrope_interleaved", True))
        rope_type = rope.get("rope_type", legacy_scaling.get("rope_type", legacy_scaling.get("type", "default")))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported (only 'default')")
        if text.get("attention_bias", False):
            raise ConfigError(f"{source}: attention_bias=true is not a Qwen3.5 setting and is not supported")
        if text.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act {text.get('hidden_act')!r} is not supported (only 'silu')")
        tie = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", True))
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        hidden = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        try:
            return cls(
                vocab_size=int(need("vocab_size")),
                hidden_size=hidden,
                intermediate_size=int(need("intermediate_size")),
                num_hidden_layers=num_layers,
                num_attention_heads=num_heads,
                num_key_value_heads=int(text.get("num_key_value_heads", num_heads)),
                head_dim=int(text.get("head_dim") or hidden // num_heads),
                linear_num_key_heads=int(need("linear_num_key_heads")),
                linear_num_value_heads=int(need("linear_num_value_heads")),
                linear_key_head_dim=int(need("linear_key_head_dim")),
                linear_value_head_dim=int(need("linear_value_head_dim")),
                linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
                layer_types=tuple(layer_types),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                partial_rotary_factor=float(prf),
                mrope_section=tuple(int(s) for s in mrope_section),
                mrope_interleaved=bool(mrope_interleaved),
                max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
                tie_word_embeddings=bool(tie),
                mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", raw.get("mtp_num_hidden_layers", 0))),
                eos_token_ids=eos_ids,
                pad_token_id=text.get("pad_token_id", raw.get("pad_token_id")),
                bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
                model_type=model_type,
            )
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json in the checkpoint directory") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: unreadable JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object at the top level")
        return cls.from_hf_dict(raw, source=str(path))

    def to_hf_dict(self) -> dict:
        """A flat `qwen3_5_text` config.json that both jaxgdn and transformers' Qwen3_5ForCausalLM load."""
        eos: Any = list(self.eos_token_ids)
        if len(eos) == 1:
            eos = eos[0]
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "layer_types": list(self.layer_types),
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": self.mrope_interleaved,
            },
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
        }


def qwen35_0_8b() -> ModelConfig:
    """The exact text-model values of Qwen/Qwen3.5-0.8B (docs/qwen35-architecture.md §1)."""
    return ModelConfig(
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(24)),
        rms_norm_eps=1e-6,
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        mrope_section=(11, 11, 10),
        mrope_interleaved=True,
        max_position_embeddings=262144,
        tie_word_embeddings=True,
        mtp_num_hidden_layers=1,
        eos_token_ids=(248046, 248044),
        pad_token_id=248044,
        model_type="qwen3_5",
    )


def _dense(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, value_heads: int,
           tied: bool) -> ModelConfig:
    """A dense Qwen3.5 size: the 0.8B's values (head_dim 256, 16 GDN key heads of 128, value heads of 128, conv
    4, a full-attention layer every 4th, vocabulary, RoPE, one MTP layer) with its own widths and depth."""
    return qwen35_0_8b().replace(
        hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate, num_attention_heads=heads,
        num_key_value_heads=kv_heads, linear_num_value_heads=value_heads, tie_word_embeddings=tied,
        layer_types=tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(layers)))


# The published text configs of Qwen/Qwen3.5-2B, -4B, -9B and -27B (their config.json on the Hugging Face Hub).
# Widths, depth, heads and the tie flag as mirrored in radixark/miles scripts/models/qwen3.5-{4B,9B,27B}.sh; GDN
# value heads and the 2B from public test fixtures that quote the config.json files. The 2B's tie flag was in
# neither: tied, as the 0.8B and 4B.
PRESETS = {
    "qwen3.5-0.8b": qwen35_0_8b,
    "qwen3.5-2b": lambda: _dense(2048, 24, 6144, 8, 2, 16, tied=True),
    "qwen3.5-4b": lambda: _dense(2560, 32, 9216, 16, 4, 32, tied=True),
    "qwen3.5-9b": lambda: _dense(4096, 32, 12288, 16, 4, 32, tied=False),
    "qwen3.5-27b": lambda: _dense(5120, 64, 17408, 24, 4, 48, tied=False),
}
