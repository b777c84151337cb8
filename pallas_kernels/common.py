"""Settings every Pallas kernel here shares: where it runs interpreted, and its Triton compiler parameters."""

from __future__ import annotations

import jax


def on_gpu() -> bool:
    """Whether JAX runs on a GPU, where the kernels compile (Triton lowering); elsewhere they interpret."""
    return jax.default_backend() == "gpu"


def interpret_default(interpret):
    """None -> interpret everywhere but on a GPU (CPU runs are tests); an explicit bool wins."""
    return not on_gpu() if interpret is None else interpret


def triton_params(num_warps: int, num_stages: int = 1):
    try:
        from jax.experimental.pallas import triton as plt

        return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    except (ImportError, AttributeError):  # pragma: no cover - older/newer Pallas spellings
        return None
