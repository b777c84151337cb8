"""transformers (+ fla when installed) as the peer of `bench decode`, `bench prefill` and `bench serve`: its
model at a jaxgdn config, timed the way a server would use it."""

from __future__ import annotations

import statistics
import time
import traceback

from .common import ensure_triton_cache_dir


def hf_model(cfg, dtype="bfloat16", device="cuda"):
    """transformers' Qwen3_5ForCausalLM at cfg with its own random init, on `device` (fla used if installed)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
    model = Qwen3_5ForCausalLM._from_config(Qwen3_5TextConfig(**d), dtype=getattr(torch, dtype))
    return model.to(device).eval()


def hf_decode_ms(model, vocab: int, batch: int, prompt_len: int, steps: int) -> float:
    """ms per greedy decode step of a plain forward loop with transformers' cache (no generate() overhead)."""
    ensure_triton_cache_dir()  # right before fla runs: it was found empty after our engine had run
    import torch

    ids = torch.randint(0, vocab, (batch, prompt_len), device="cuda")
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            nxt.cpu()  # a server needs the token on the host each step
            times.append(time.perf_counter() - t0)
            cache = out.past_key_values
    return statistics.median(times[2:]) * 1e3


def hf_prefill_ms(model, vocab: int, batch: int, length: int, repeats: int = 7, warmup: int = 2) -> float:
    """Median ms of transformers' prefill forward (logits of the last token), after `warmup` untimed
    calls (fla autotunes its kernels for a new shape on the first); its calls vary, hence several."""
    ensure_triton_cache_dir()  # right before fla runs: it was found empty after our engine had run
    import torch

    ids = torch.randint(0, vocab, (batch, length), device="cuda")
    runs = []
    with torch.no_grad():
        for i in range(warmup + repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False, logits_to_keep=1).logits.argmax(-1).cpu()
            if i >= warmup:
                runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1e3


def record_peer(row: dict, key: str, ours_ms: float, measure, save) -> str:
    """Save our row, then (measure not None) record the peer's time under row[key] and our speed-up over
    it and save again. A peer failure (out of memory, a missing kernel) is recorded as
    row["transformers_error"] instead of ending the benchmark. Returns the text for the printed line."""
    save()  # ours is kept even if the peer fails
    if measure is None:
        return ""
    try:
        peer_ms = measure()
    except Exception as e:  # noqa: BLE001
        row["transformers_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["transformers_traceback"] = traceback.format_exc(limit=-8)[-3000:]
        save()
        return f"  transformers failed: {row['transformers_error']}"
    row[key] = peer_ms
    row["speedup_vs_transformers"] = peer_ms / ours_ms
    save()
    return f"  transformers {peer_ms:.2f} ms ({peer_ms / ours_ms:.1f}x)"


def peer_model_or_none(cfg, want: bool):
    """transformers' model at cfg on the GPU, or None (not wanted, no CUDA in torch, or it failed to build)."""
    if not want:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            print("transformers peer skipped: torch has no CUDA device")
            return None
        return hf_model(cfg)
    except Exception as e:  # noqa: BLE001
        print(f"transformers peer skipped ({type(e).__name__}: {e})")
        return None
