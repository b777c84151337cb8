"""The EngineConfig flags shared by the command lines (generate, serve), and the config they make."""

from __future__ import annotations

import argparse
import os

from .engine.config import (
    ASYNC_SCHEDULING_CHOICES,
    KERNEL_CHOICES,
    LIBRARY_GEMMS_MIN_TOKENS,
    EngineConfig,
    min_tokens_arg,
)


def add_engine_args(ap: argparse.ArgumentParser, **defaults) -> argparse._ArgumentGroup:
    """Add the engine flags to ap; defaults overrides a flag's default by its dest (e.g. max_num_seqs=16)."""
    d = {"max_num_seqs": 256, "max_num_batched_tokens": 4096, "max_model_len": 2048, "dtype": "bfloat16",
         "num_speculative_tokens": 0, **defaults}
    e = ap.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"], help="requests running at once (default %(default)s)")
    e.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"],
                   help="tokens in one step; longer prompts are chunked (default %(default)s)")
    e.add_argument("--max-model-len", type=int, default=d["max_model_len"],
                   help="longest prompt + output (default %(default)s)")
    e.add_argument("--kv-page-size", type=int, default=16)
    e.add_argument("--num-kv-pages", type=int, default=None,
                   help="KV pages (default: planned from --gpu-memory-utilization on a GPU, else every slot at "
                        "max_model_len)")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the device's memory the engine may use (default %(default)s)")
    e.add_argument("--enforce-eager", action="store_true", help="exact shapes, no bucket padding")
    e.add_argument("--precompile", choices=["on", "off"], default=d.get("precompile"),
                   help="compile every step program before serving (default on)")
    e.add_argument("--dtype", choices=["bfloat16", "float32"], default=d["dtype"], help="(default %(default)s)")
    e.add_argument("--gdn-impl", choices=KERNEL_CHOICES, default="auto",
                   help="GDN kernels: auto (Pallas on a GPU, XLA elsewhere), xla, pallas")
    e.add_argument("--attention-impl", choices=KERNEL_CHOICES, default="auto",
                   help="attention kernels: auto (Pallas on a GPU, XLA elsewhere), xla, pallas")
    e.add_argument("--input-impl", choices=["xla", "pallas", "triton"], default="xla",
                   help="input-assembly kernel (triton needs a GPU with jax-triton)")
    e.add_argument("--num-speculative-tokens", type=int, default=d["num_speculative_tokens"],
                   help="MTP drafts per step, 0..3 (default %(default)s)")
    e.add_argument("--async-scheduling", choices=list(ASYNC_SCHEDULING_CHOICES), default="auto",
                   help="launch each step before the previous step's tokens are back (host work overlaps the "
                        "device; same outputs; with MTP drafts the next verify step starts where the device's count "
                        "of accepted drafts says). auto (default): on unless --pd; on: refused with --pd")
    e.add_argument("--decode-steps-per-launch", type=int, default=None, metavar="N",
                   help="run N model steps per device launch when every request is decoding: decode steps "
                        "(async scheduling) or MTP verify steps (not --pd); same outputs, the host's per-step "
                        "cost is paid once per launch. Default: 4 on a GPU, 1 elsewhere")
    e.add_argument("--no-fold-norms", action="store_true",
                   help="serve the loaded weights' values exactly: keep each layer's RMSNorm weight apart instead "
                        "of folding it into the projections that read it (the default; same math, rounding at "
                        "the weight dtype's precision; one kernel fewer per norm in a single-token step)")
    e.add_argument("--no-fused-decode-kernels", action="store_true",
                   help="run decode and verify rows on the layers' kernel chains instead of the one-kernel GDN "
                        "mixer and decode attention (same math; e.g. to rule those kernels out when chasing a "
                        "problem). They run on a GPU, or off it with the Pallas paths asked for")
    e.add_argument("--library-gemms-min-tokens", type=min_tokens_arg, default=LIBRARY_GEMMS_MIN_TOKENS,
                   metavar="N|off",
                   help="steps of at least N tokens (prompts) compile their matrix products for cuBLAS instead of "
                        "XLA's Triton GEMMs, which lets XLA add the residual stream inside the products; GPU "
                        f"only (default {LIBRARY_GEMMS_MIN_TOKENS}; off: never)")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model's heads, MLP and vocabulary over N devices (a mesh axis; with --pd, N for "
                        "each worker); N must divide the head counts (default 1)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages and GDN state of prompt prefixes computed before (exact: same outputs; "
                        "default on)")
    e.add_argument("--prefix-cache-state-interval", type=int, default=256, metavar="TOKENS",
                   help="GDN state snapshots where a prompt reaches a multiple of this many tokens inside a prefix "
                        "another request computed (every 4th multiple elsewhere) and where requests end; a hit resumes "
                        "at the last one inside the shared prefix (a multiple of --kv-page-size; default %(default)s)")
    e.add_argument("--num-state-snapshots", type=int, default=None,
                   help="GDN state snapshots the prefix cache keeps (default: a tenth of the KV pages' memory on a "
                        "GPU, two per request slot elsewhere)")
    e.add_argument("--pd", action="store_true", help="prefill/decode disaggregation with explicit state handoff")
    e.add_argument("--reproduce-pd-mtp-bug", action="store_true",
                   help="restore vLLM's pre-#47466 behaviour (wrong outputs under PD + MTP, concurrency > 1)")
    return e


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig of the parsed engine flags (ValueError names a bad one)."""
    fields = {
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len, "kv_page_size": args.kv_page_size, "num_kv_pages": args.num_kv_pages,
        "gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": args.enforce_eager, "dtype": args.dtype,
        "input_impl": args.input_impl, "gdn_impl": args.gdn_impl, "attention_impl": args.attention_impl,
        "num_speculative_tokens": args.num_speculative_tokens,
        "pd": args.pd, "reproduce_pd_mtp_bug": args.reproduce_pd_mtp_bug,
        "async_scheduling": ASYNC_SCHEDULING_CHOICES[args.async_scheduling],
        "decode_steps_per_launch": args.decode_steps_per_launch, "fold_norms": not args.no_fold_norms,
        "fused_decode_kernels": not args.no_fused_decode_kernels, "library_gemms_min_tokens": args.library_gemms_min_tokens,
        "precompile": args.precompile != "off", "tensor_parallel_size": args.tensor_parallel_size,
        "enable_prefix_caching": args.enable_prefix_caching,
        "prefix_cache_state_interval": args.prefix_cache_state_interval, "num_state_snapshots": args.num_state_snapshots,
    }
    config = EngineConfig(**{**fields, **overrides})
    use_memory_fraction(config.gpu_memory_utilization)
    return config


def use_memory_fraction(fraction: float) -> None:
    """Let JAX's allocator take `fraction` of each GPU (its default is 75%), so --gpu-memory-utilization means
    a fraction of the GPU's memory, as in vLLM; a fraction the user set in the environment stands. Takes
    effect if no GPU was used yet in this process (and in the processes it starts)."""
    if not (os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")):
        os.environ["XLA_CLIENT_MEM_FRACTION"] = str(fraction)


def add_distributed_args(ap: argparse.ArgumentParser) -> None:
    """Flags of a run over several processes (hosts): one engine whose mesh spans every process's devices."""
    g = ap.add_argument_group("multi-host (jax.distributed)")
    g.add_argument("--coordinator-address", metavar="HOST:PORT",
                   help="process 0's address; every process runs the same command with its own --process-id")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    g.add_argument("--process-id", type=int, default=None, help="this process's index, 0..num_processes-1")


def init_distributed(args: argparse.Namespace) -> bool:
    """jax.distributed.initialize from the flags, before JAX first touches a device; True on process 0 (the
    one that prints) or when the run is a single process."""
    if not args.coordinator_address:
        return True
    import jax

    jax.distributed.initialize(args.coordinator_address, num_processes=args.num_processes, process_id=args.process_id)
    return jax.process_index() == 0
