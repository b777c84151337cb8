"""Result files of the benchmarks and the eval CLI: JSON with the device, versions and date."""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"


def environment(xla_flags: str = "") -> dict:
    """Device, versions and date for every result file; xla_flags: the run's $XLA_FLAGS (its CLI reads it)."""
    import jax
    import jaxlib

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(jax.devices()[0].device_kind),
        "num_devices": jax.device_count(),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "xla_flags": xla_flags,  # e.g. command-buffer (CUDA graph) settings
    }
    for name in ("torch", "transformers", "triton", "fla", "jax_triton"):
        try:
            env[name] = __import__(name).__version__
        except Exception:
            env[name] = None
    return env


def write_result(name: str, payload: dict, path: Path | None = None) -> Path:
    """Write payload as JSON to path, default bench/results/<name>_<backend>_<date>.json."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    path = path or RESULTS_DIR / f"{name}_{payload['env']['backend']}_{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
