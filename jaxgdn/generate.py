"""`python -m jaxgdn.generate`: run the model on prompts.

The serving engine (scheduler, sampling, MTP, PD) arrives with later issues. Until a default checkpoint
ships in `checkpoints/`, this loads a checkpoint you name with `--model` and greedily continues token-id
prompts with the dense-cache model, so the model and loader can be exercised end to end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

CHECKPOINTS_DIR = Path(__file__).resolve().parent.parent / "checkpoints"


def default_checkpoint() -> Path | None:
    """The first checkpoint directory shipped in checkpoints/ (one with a config.json), if any."""
    found = sorted(p.parent for p in CHECKPOINTS_DIR.glob("*/config.json"))
    return found[0] if found else None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m jaxgdn.generate",
        description="Greedy generation with jaxgdn's Qwen3.5 model (dense cache, one jitted step per token).",
    )
    ap.add_argument("--model", help="checkpoint directory (config.json + safetensors); default: the one in checkpoints/")
    ap.add_argument("--prompt-ids", action="append", default=[],
                    help="comma-separated token ids, repeatable (text prompts need the tokenizer of a later issue)")
    ap.add_argument("--max-tokens", type=int, default=16, help="new tokens per prompt (default 16)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32", help="weight dtype (default float32)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    model = Path(args.model) if args.model else default_checkpoint()
    if model is None:
        print(
            "jaxgdn: no default checkpoint ships in checkpoints/ yet (the trained tiny model is a later issue).\n"
            "Run with --model /path/to/a/Qwen3.5/checkpoint --prompt-ids 1,2,3 to generate from your own weights.",
            file=sys.stderr,
        )
        return 2
    if args.max_tokens < 1:
        print("jaxgdn: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        prompts = [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt_ids] or [[1]]
    except ValueError:
        print("jaxgdn: --prompt-ids takes comma-separated integers, e.g. 1,306,4658", file=sys.stderr)
        return 2

    import jax
    import jax.numpy as jnp

    from .checkpoint import CheckpointError, load_checkpoint
    from .config import ConfigError
    from .model import forward
    from .state import init_cache

    try:
        cfg, params = load_checkpoint(model, dtype=getattr(jnp, args.dtype))
    except (CheckpointError, ConfigError) as e:
        print(f"jaxgdn: {e}", file=sys.stderr)
        return 2
    step = jax.jit(forward, static_argnums=1, donate_argnums=3)
    for prompt in prompts:
        bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if not prompt or bad:
            print(f"prompt {prompt}: skipped (empty or ids outside [0, {cfg.vocab_size}): {bad})", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        cache = init_cache(cfg, 1, len(prompt) + args.max_tokens, dtype=params.embed_tokens.dtype)
        logits, _, cache = step(params, cfg, jnp.asarray([prompt], jnp.int32), cache)
        out = []
        for _ in range(args.max_tokens):
            token = int(jnp.argmax(logits[0, -1]))
            out.append(token)
            if token in cfg.eos_token_ids:
                break
            logits, _, cache = step(params, cfg, jnp.asarray([[token]], jnp.int32), cache)
        dt = time.perf_counter() - t0
        print(f"prompt {prompt} -> {out}  ({len(out)} tokens, {len(out) / dt:.1f} tok/s incl. compile)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
