"""transformers (+ fla when installed) as the peer of `bench decode`, `bench prefill` and `bench serve`: its
model at a jaxgdn config, timed the way a server would use it."""

from __future__ import annotations

import os
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


def serve_peer(args, requests) -> dict:
    """transformers on the same requests (greedy, every output to its length): `generate_batch` (continuous
    batching); where that fails, `generate` at batch 32 with left padding. Wall time and tokens/s."""
    import torch
    from transformers import GenerationConfig

    from ..model.config import PRESETS, ModelConfig

    cfg = (PRESETS[args.model]() if args.model in PRESETS
           else ModelConfig.from_json_file(os.path.join(args.model, "config.json")))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = hf_model(cfg, device=device)
    prompts = [p for p, _ in requests]
    longest = max(o for _, o in requests)
    row = {"device": device}
    t0 = time.perf_counter()
    try:
        gen = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs = model.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
        generated = sum(len(o.generated_tokens) for o in outs.values())
        row["form"] = "generate_batch"
    except Exception as e:  # noqa: BLE001  (a hybrid cache it does not take)
        row["generate_batch_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        t0 = time.perf_counter()
        generated = 0
        for i in range(0, len(requests), 32):
            batch = requests[i : i + 32]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(o for _, o in batch),
                                 min_new_tokens=max(o for _, o in batch), do_sample=False, pad_token_id=0)
            generated += int(out.shape[0] * (out.shape[1] - width))
        row["form"] = "generate, batch 32, left padding"
    wall = time.perf_counter() - t0
    prompt_tokens = sum(len(p) for p in prompts)
    row.update(wall_s=wall, output_tokens=generated, total_tokens_per_s=(prompt_tokens + generated) / wall,
               output_tokens_per_s=generated / wall, note="every request generates the longest request's output")
    return row
