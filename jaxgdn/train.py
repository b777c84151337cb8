"""`python -m jaxgdn.train`: train a tiny Qwen3.5 (trunk + MTP head) on the arithmetic word problems.

Loss = next-token cross-entropy on the answer (solution + eos) + `--mtp-weight` x the MTP head's
cross-entropy on the token after next, both from our own model functions (`model.forward`,
`mtp.mtp_forward`). Master weights fp32, forward in `--compute-dtype` (bfloat16 by default, the dtype
the checkpoint ships in), AdamW with warmup + cosine decay and global-norm clipping (optax).
Data are drawn fresh from the train split's seeded stream, so `--seed` fixes init and data.
Writes a Hugging Face checkpoint directory (config.json, model.safetensors with mtp.*, tokenizer.json,
generation_config.json, chat_template.jinja, train_log.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from . import task
from .model.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig


def tiny_config(vocab_size: int, hidden: int = 256, layers: int = 8) -> ModelConfig:
    """The Qwen3.5 family at small width: layers L,L,L,F repeated, gated attention, GDN with Hv = 2 Hk,
    one MTP layer, tied embeddings."""
    if layers % 4:
        raise ValueError("layers must be a multiple of 4 (the L,L,L,F pattern)")
    head_dim = 64
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=max(1, hidden // (2 * head_dim)),
        head_dim=head_dim,
        linear_num_key_heads=max(1, hidden // (2 * head_dim)),
        linear_num_value_heads=hidden // head_dim,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=4,
        layer_types=tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(layers)),
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        mrope_section=(3, 3, 2),  # sums to rotary_dim / 2 = 8 (text positions make it inert)
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        mtp_num_hidden_layers=1,
        eos_token_ids=(task.SPECIAL_TOKENS.index(task.EOS),),
        pad_token_id=task.SPECIAL_TOKENS.index(task.PAD),
    )


class Batches:
    """Fresh train-split problems -> (ids [B, T] int32, answer mask [B, T] f32), padded with pad id.

    mask[b, t] = 1 where ids[b, t] is part of the answer (solution + eos): the positions the loss targets.
    Sequences longer than T are dropped (counted in `dropped`)."""

    def __init__(self, tok, batch: int, seq_len: int, seed: int, split: str = "train"):
        self.tok, self.batch, self.seq_len = tok, batch, seq_len
        self.stream = task.problems(split, seed_offset=seed)
        self.eos = tok.token_to_id(task.EOS)
        self.pad = tok.token_to_id(task.PAD)
        self.dropped = 0

    def __next__(self):
        ids = np.full((self.batch, self.seq_len), self.pad, np.int32)
        mask = np.zeros((self.batch, self.seq_len), np.float32)
        b = 0
        while b < self.batch:
            seq, n_prompt = task.encode_example(self.tok, next(self.stream), self.eos)
            if len(seq) > self.seq_len:
                self.dropped += 1
                continue
            ids[b, : len(seq)] = seq
            mask[b, n_prompt : len(seq)] = 1.0
            b += 1
        return ids, mask


def make_loss(cfg: ModelConfig, mtp_weight: float, compute_dtype, gdn_chunked: bool = True):
    """loss(params, ids, mask) -> (total, (trunk CE, MTP CE, trunk answer-token accuracy))."""
    import jax
    import jax.numpy as jnp

    from .model.forward import forward
    from .model.mtp import mtp_forward
    from .model.params import cast_params

    def ce(logits, targets, weights):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return (nll * weights).sum() / jnp.maximum(weights.sum(), 1.0)

    def loss(params, ids, mask):
        p = cast_params(cfg, params, compute_dtype)  # fp32 master weights, forward in compute_dtype
        inputs, targets, w = ids[:, :-1], ids[:, 1:], mask[:, 1:]
        logits, hidden, _ = forward(p, cfg, inputs, gdn_chunked=gdn_chunked)
        trunk = ce(logits, targets, w)
        # MTP at position i: hidden h_i + embedding of t_{i+1} -> t_{i+2}
        mtp_logits, _, _ = mtp_forward(p, cfg, hidden[:, :-1], inputs[:, 1:])
        mtp = ce(mtp_logits, targets[:, 1:], w[:, 1:])
        acc = ((logits.argmax(-1) == targets) * w).sum() / jnp.maximum(w.sum(), 1.0)
        return trunk + mtp_weight * mtp, (trunk, mtp, acc)

    return loss


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m jaxgdn.train", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="checkpoints/qwen35-tiny-arith", help="checkpoint directory to write")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=448, help="tokens per training sequence (longer ones are skipped)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--compute-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0, help="init and data stream")
    ap.add_argument("--gdn-chunked", action=argparse.BooleanOptionalAction, default=None,
                    help="the GDN recurrence's chunked form in the training forward, else the token scan (default: "
                         "chunked on GPU, scan on CPU, where jaxlib 0.10's batched LAPACK triangular solve can "
                         "deadlock under jax.grad)")
    ap.add_argument("--eval-every", type=int, default=500, help="validation loss every N steps (0 = off)")
    ap.add_argument("--log-every", type=int, default=50)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import optax
    from tqdm import tqdm

    from .model.checkpoint import save_checkpoint
    from .model.params import cast_params, init_random_params

    if args.gdn_chunked is None:
        # Seen with jaxlib 0.10.2 on a 2-core CPU: two triangular-solve custom calls of the backward
        # running at once wait on each other's thread-pool tasks forever (ParallelBatchMap). The scan
        # has no triangular solve.
        args.gdn_chunked = jax.default_backend() != "cpu"
    tok = task.build_tokenizer()
    cfg = tiny_config(tok.get_vocab_size(), args.hidden, args.layers)
    params = init_random_params(cfg, seed=args.seed, dtype=jnp.float32)
    n_params = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
    print(f"jaxgdn.train: {n_params / 1e6:.2f}M parameters, layers {cfg.layer_types}, vocab {cfg.vocab_size}, "
          f"device {jax.devices()[0].device_kind}")

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1),
                                                  end_value=args.lr * 0.05)
    decay_mask = jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay_mask))
    opt_state = opt.init(params)
    loss_fn = make_loss(cfg, args.mtp_weight, jnp.dtype(args.compute_dtype), args.gdn_chunked)

    @jax.jit
    def train_step(params, opt_state, ids, mask):
        (total, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, ids, mask)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, total, aux

    eval_loss = jax.jit(loss_fn)
    train_batches = Batches(tok, args.batch, args.seq_len, args.seed)
    val_ids, val_mask = next(Batches(tok, args.batch, args.seq_len, 0, split="validation"))
    log: list[dict] = []
    t0 = time.time()
    bar = tqdm(range(1, args.steps + 1), desc="train", unit="step", dynamic_ncols=True)
    for step in bar:
        ids, mask = next(train_batches)
        params, opt_state, total, (trunk, mtp, acc) = train_step(params, opt_state, ids, mask)
        if step % args.log_every == 0 or step == args.steps:
            row = {"step": step, "loss": float(total), "trunk_ce": float(trunk), "mtp_ce": float(mtp),
                   "answer_token_acc": float(acc), "lr": float(schedule(step)), "elapsed_s": time.time() - t0}
            if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
                v_total, (v_trunk, v_mtp, v_acc) = eval_loss(params, val_ids, val_mask)
                row.update(val_trunk_ce=float(v_trunk), val_mtp_ce=float(v_mtp), val_answer_token_acc=float(v_acc))
            log.append(row)
            bar.set_postfix(loss=f"{row['loss']:.4f}", ce=f"{row['trunk_ce']:.4f}", mtp=f"{row['mtp_ce']:.4f}",
                            acc=f"{row['answer_token_acc']:.4f}")
    bar.close()
    if not np.isfinite(log[-1]["loss"]):
        print("jaxgdn.train: loss is not finite; not saving", file=sys.stderr)
        return 1

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(task.CHAT_TEMPLATE)
    save_checkpoint(out, cfg, cast_params(cfg, params, jnp.dtype(args.save_dtype)))
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": list(cfg.eos_token_ids), "pad_token_id": cfg.pad_token_id, "do_sample": False,
         "max_new_tokens": 192}, indent=2) + "\n")
    (out / "train_log.json").write_text(json.dumps(
        {"args": vars(args), "num_parameters": n_params, "device": jax.devices()[0].device_kind,
         "jax": jax.__version__, "optax": optax.__version__, "dropped_long_examples": train_batches.dropped,
         "wall_s": time.time() - t0, "log": log}, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"jaxgdn.train: wrote {out} ({size / 1e6:.1f} MB of weights); final loss {log[-1]['loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
