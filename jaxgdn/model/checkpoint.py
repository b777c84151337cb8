"""Hugging Face checkpoint loading and saving (config.json + safetensors, single-file or sharded).

Accepted key layouts (docs/qwen35-architecture.md §2): `model.language_model.*` (multimodal Qwen3_5ForConditionalGeneration)
or `model.*` (text-only); top-level `lm_head.weight` (absent when tied; ignored if present and tied)
and `mtp.*`; `model.visual.*` is skipped. Saving writes the text-only layout that both jaxgdn and
transformers' Qwen3_5ForCausalLM read, so a saved checkpoint reloads identically.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from .config import ConfigError, ModelConfig
from .params import ModelParams, expected_tensor_shapes, params_from_tensors, params_to_tensors, tensor_dtype

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SKIPPED_PREFIXES = ("model.visual.",)


class CheckpointError(ValueError):
    """A checkpoint jaxgdn cannot load; the message names the file and the tensor(s)."""


def canonical_name(key: str) -> str | None:
    """Map a checkpoint key to jaxgdn's canonical (text-only) name, or None for tensors we skip."""
    if key.startswith(SKIPPED_PREFIXES):
        return None
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model.") :]
    return key


def _tensor_files(ckpt: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file that holds it (through the index when there is one)."""
    index = ckpt / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e!r}); expected a JSON object with 'weight_map'")
        missing_files = sorted({f for f in weight_map.values() if not (ckpt / f).exists()})
        if missing_files:
            raise CheckpointError(f"{index}: shard file(s) listed in weight_map do not exist: {missing_files}")
        return {k: ckpt / f for k, f in weight_map.items()}
    files = [ckpt / SINGLE_FILE] if (ckpt / SINGLE_FILE).exists() else sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{ckpt}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors files")
    out: dict[str, Path] = {}
    for f in files:
        with _open(f) as st:
            for k in st.keys():
                out[k] = f
    return out


def _open(path: Path):
    try:
        return safe_open(str(path), framework="np")
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def load_config(path: str | Path) -> ModelConfig:
    return ModelConfig.from_json_file(Path(path) / "config.json")


def load_checkpoint(path: str | Path, dtype=jnp.bfloat16, include_mtp: bool = True) -> tuple[ModelConfig, ModelParams]:
    """Load config.json + safetensors from a directory. Weights in `dtype` (fp32 or bf16); A_log and the
    GDN gated-norm weight stay fp32. Returns (config, params); params.mtp is None without an MTP head."""
    ckpt = Path(path)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: not a checkpoint directory")
    cfg = load_config(ckpt)
    files = _tensor_files(ckpt)
    by_name: dict[str, tuple[str, Path]] = {}
    for key, f in files.items():
        name = canonical_name(key)
        if name is not None:
            by_name[name] = (key, f)

    mtp_layer_ids = {int(m.group(1)) for n in by_name if (m := re.match(r"mtp\.layers\.(\d+)\.", n))}
    if mtp_layer_ids and not cfg.has_mtp:
        cfg = cfg.replace(mtp_num_hidden_layers=max(mtp_layer_ids) + 1)
    has_mtp_tensors = any(n.startswith("mtp.") for n in by_name)
    use_mtp = include_mtp and cfg.has_mtp and has_mtp_tensors
    if include_mtp and cfg.has_mtp and not has_mtp_tensors:
        warnings.warn(f"{ckpt}: config asks for an MTP head but there are no mtp.* tensors; loading without it")

    expected = expected_tensor_shapes(cfg, include_mtp=use_mtp)
    missing = [n for n in expected if n not in by_name]
    if missing:
        raise CheckpointError(f"{ckpt}: {len(missing)} tensor(s) missing from the checkpoint: {missing}")
    unexpected = [n for n in by_name if n not in expected and not n.startswith("mtp.") and n != "lm_head.weight"]
    if unexpected:
        warnings.warn(f"{ckpt}: ignoring {len(unexpected)} unexpected tensor(s): {unexpected[:10]}")

    tensors = {}
    handles: dict[Path, object] = {}
    try:
        for name, shape in expected.items():
            key, f = by_name[name]
            if f not in handles:
                handles[f] = _open(f)
            st = handles[f]
            found = tuple(st.get_slice(key).get_shape())
            if found != shape:
                raise CheckpointError(f"{f}: tensor {key!r} has shape {list(found)}, expected {list(shape)}")
            tensors[name] = jnp.asarray(st.get_tensor(key), dtype=tensor_dtype(name, dtype))
    finally:
        handles.clear()
    return cfg, params_from_tensors(cfg, tensors, include_mtp=use_mtp)


def save_checkpoint(
    path: str | Path,
    cfg: ModelConfig,
    params: ModelParams,
    max_shard_bytes: int | None = None,
    extra_files: dict[str, str | Path] | None = None,
) -> Path:
    """Write config.json and safetensors in the text-only HF layout (`model.*`, `lm_head`, `mtp.*`).

    Shards into `model-0000i-of-0000n.safetensors` + index.json when the weights exceed max_shard_bytes.
    extra_files: name -> source path copied beside them (tokenizer.json, generation_config.json, ...).
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = cfg.replace(mtp_num_hidden_layers=cfg.mtp_num_hidden_layers if params.mtp is not None else 0)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    tensors = {name: np.asarray(value) for name, value in params_to_tensors(cfg, params).items()}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if max_shard_bytes is not None and shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    for stale in list(out.glob("*.safetensors")) + [out / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
        total = sum(a.nbytes for a in tensors.values())
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    for name, src in (extra_files or {}).items():
        shutil.copyfile(src, out / name)
    return out


__all__ = ["CheckpointError", "ConfigError", "load_checkpoint", "load_config", "save_checkpoint", "canonical_name"]
