"""Engine configuration (names follow vLLM's engine arguments)."""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax.numpy as jnp

from ..model.policy import KernelPolicy

# --async-scheduling on the command lines: its choices and the EngineConfig value each means
ASYNC_SCHEDULING_CHOICES = {"auto": None, "on": True, "off": False}
KERNEL_CHOICES = ("auto", "xla", "pallas")  # gdn_impl and attention_impl
INPUT_IMPLS = ("xla", "pallas", "triton")  # input_impl
LIBRARY_GEMMS_MIN_TOKENS = KernelPolicy().library_gemms_min_tokens


def min_tokens_arg(text: str) -> int | None:
    """--library-gemms-min-tokens on the command lines: 'off' -> None, else a token count >= 0."""
    if text.lower() == "off":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a token count >= 0 or 'off', got {text!r}")
    return int(text)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine batches, caches and compiles.

    max_num_seqs: running requests at once (= persistent request slots; slot 0 is the null slot).
    max_num_batched_tokens: token budget of one step (chunked prefill splits longer prompts); the largest
      step program's tokens.
    max_model_len: longest sequence (prompt + output) a request may reach.
    kv_page_size / num_kv_pages: the paged KV pool; num_kv_pages None = planned from gpu_memory_utilization
      where the device reports its memory (`memory.plan_memory`), else enough for every slot at max_model_len.
    gpu_memory_utilization: the fraction of the device's memory the engine may use (vLLM's knob): the weights,
      the GDN slots, the largest step program's temporaries, and the KV pages, which get what remains.
    enforce_eager: run exact shapes (no bucket padding); each new shape compiles once.
    dtype: weight and activation dtype ("bfloat16" or "float32"); the GDN recurrent state is fp32.
    input_impl: the input-assembly kernel (`pallas_kernels/input_assembly.py`): "xla", "pallas" (Triton
      through Pallas; interpret mode off the GPU) or "triton" (jax-triton).
    gdn_impl / attention_impl: the layers' kernels (`KernelPolicy`): "auto" (the Pallas kernels on a GPU, the
      XLA forms elsewhere), "xla" (the XLA forms everywhere) or "pallas" (the kernels also off the GPU, in
      interpret mode: for tests).
    num_speculative_tokens: K MTP drafts verified per step (0 = no speculative decoding).
    pd: run prefill and decode in separate workers with explicit state handoff (PD disaggregation).
    pad_prompt_tail: pad a 1-token prompt tail to 1+K placeholder drafts when other requests are
      running and no prefill is scheduled (vLLM #45237), keeping steps uniform.
    reproduce_pd_mtp_bug: restore vLLM's pre-#47466 behaviour (unguarded last_sampled overwrite and the
      old spec-row rule num_computed >= num_prompt). For demonstrations and tests only.
    prefill_device / decode_device: JAX device indices of the PD workers (None: the default device).
    precompile: `LLM(...)` compiles every step program of the engine (`programs.ProgramSet`) before it serves,
      so traffic never waits on the compiler; False compiles each program when a step first needs it.
    compilation_cache: keep compiled step programs on disk across runs (JAX's persistent compilation
      cache) in $JAXGDN_CACHE_DIR, default ~/.cache/jaxgdn/jax; a second start-up reloads instead of compiling.
    async_scheduling: schedule and launch step n+1 before step n's tokens are back, so host work overlaps
      the device (vLLM's async scheduling); same outputs. With MTP drafts a verify launch is booked as if
      every draft were accepted and the next launch starts where the device's count says
      (EngineState.num_computed). Not with PD. None (default): on wherever it can be (not PD).
    fold_norms: serve with each decoder layer's RMSNorm weights folded into the projections that read them
      (`params.fold_norms`), so a decode step's norms cost one kernel each instead of two. Same math; the
      rounding differs at the weight dtype's precision. False serves the loaded weights' values exactly.
    fused_decode_kernels: launches of several decode or verify steps run the layers' one-kernel forms between
      their two products where the kernels run (the GDN mixer, the decode attention); False runs the chains
      they replace, e.g. to rule them out when chasing a problem.
    decode_steps_per_launch: run this many model steps in one launch of the device program when no
      waiting request could start and either every row is a plain decode with room for them (with async
      scheduling; vLLM's former multi-step scheduling) or, with MTP (num_speculative_tokens > 0, not PD),
      every row is a verify window with room for that many windows (the device moves each row on by the
      drafts it accepted). Same outputs; the host's per-step work is paid once per launch. A request that
      stops early discards the rest of its launch's tokens; a waiting request that arrives meanwhile
      starts after the launch. None (default): 4 on a GPU, 1 elsewhere.
    library_gemms_min_tokens: step programs of at least this many tokens compile their matrix products for
      cuBLAS(Lt) instead of XLA's Triton GEMMs, so XLA folds the residual adds into the products' epilogues;
      None turns it off. No effect off the GPU.
    enable_prefix_caching: reuse the KV pages and GDN state of prefixes computed before (docs/prefix-caching.md):
      pages are shared by content, the GDN state is resumed from snapshots. A PD prefill worker caches; its
      decode worker imports every request's state and does not. Same outputs as without it.
    prefix_cache_state_interval: GDN state snapshots are taken where a prompt's chunk ends at a multiple of
      this many tokens inside a prefix another request computed already, and at every 4th multiple elsewhere
      (the scheduler cuts chunks there), besides where requests end; a multiple of kv_page_size. Smaller
      resumes closer to where prompts part, at the cost of more chunks and snapshots.
    num_state_snapshots: snapshots the pool holds (None: planned by `memory.plan_memory`).
    tensor_parallel_size: devices each engine (each PD worker) splits the model's heads, MLP and vocabulary
      over (`tensor_parallel.py`); they must divide the model's head counts. A PD worker's devices are the
      tensor_parallel_size consecutive ones from prefill_device / decode_device (default 0).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    kv_page_size: int = 16
    num_kv_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    dtype: str = "bfloat16"
    input_impl: str = "xla"
    gdn_impl: str = "auto"
    attention_impl: str = "auto"
    num_speculative_tokens: int = 0
    pd: bool = False
    pad_prompt_tail: bool = True
    reproduce_pd_mtp_bug: bool = False
    prefill_device: int | None = None
    decode_device: int | None = None
    precompile: bool = True
    compilation_cache: bool = True
    async_scheduling: bool | None = None
    decode_steps_per_launch: int | None = None
    fold_norms: bool = True
    fused_decode_kernels: bool = True
    library_gemms_min_tokens: int | None = LIBRARY_GEMMS_MIN_TOKENS
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    prefix_cache_state_interval: int = 256
    num_state_snapshots: int | None = None

    def __post_init__(self):
        checks = [
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.max_model_len >= 2, "max_model_len must be >= 2"),
            (self.kv_page_size >= 1, "kv_page_size must be >= 1"),
            (self.num_kv_pages is None or self.num_kv_pages >= 2, "num_kv_pages must be >= 2 (page 0 is the null page)"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"),
            (self.dtype in ("bfloat16", "float32"), "dtype must be 'bfloat16' or 'float32'"),
            (0 <= self.num_speculative_tokens <= 3, "num_speculative_tokens must be in 0..3"),
            (self.input_impl in INPUT_IMPLS, f"input_impl must be one of {INPUT_IMPLS}"),
            (self.attention_impl in KERNEL_CHOICES, "attention_impl must be 'auto', 'xla' or 'pallas'"),
            (self.gdn_impl in KERNEL_CHOICES, "gdn_impl must be 'auto', 'xla' or 'pallas'"),
            (self.async_scheduling is not True or not self.pd,
             "async_scheduling needs pd=False (a PD handoff is only known once its step's results are back)"),
            (self.decode_steps_per_launch is None or self.decode_steps_per_launch >= 1,
             "decode_steps_per_launch must be >= 1"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
            (self.prefix_cache_state_interval >= 1 and self.prefix_cache_state_interval % self.kv_page_size == 0,
             "prefix_cache_state_interval must be a positive multiple of kv_page_size"),
            (self.num_state_snapshots is None or self.num_state_snapshots >= 1, "num_state_snapshots must be >= 1"),
            (self.library_gemms_min_tokens is None or self.library_gemms_min_tokens >= 0,
             "library_gemms_min_tokens must be >= 0 or None"),
            (self.decode_steps_per_launch in (None, 1) or self.uses_async_scheduling
             or (self.num_speculative_tokens and not self.pd),
             "decode_steps_per_launch > 1 needs async scheduling (num_speculative_tokens=0, pd=False, "
             "async_scheduling not off) or MTP verify steps (num_speculative_tokens > 0, pd=False)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"EngineConfig: {msg}")

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def max_pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.kv_page_size)

    @property
    def num_slots(self) -> int:
        """Persistent request slots including the null slot 0."""
        return self.max_num_seqs + 1

    @property
    def uses_async_scheduling(self) -> bool:
        """async_scheduling resolved: None means on wherever it can be."""
        if self.async_scheduling is None:
            return not self.pd
        return self.async_scheduling

    def resolved_decode_steps(self, platform: str) -> int:
        """decode_steps_per_launch resolved for a device platform ("gpu", "cpu", ...)."""
        if self.pd or not (self.uses_async_scheduling or self.num_speculative_tokens):
            return 1
        if self.decode_steps_per_launch is None:
            return 4 if platform in ("gpu", "cuda", "rocm") else 1
        return self.decode_steps_per_launch

    def kernel_policy(self, platform: str) -> KernelPolicy:
        """The engine's KernelPolicy on a device platform ("gpu", "cpu", ...)."""
        gpu = platform in ("gpu", "cuda", "rocm")
        wanted = lambda impl: impl == "pallas" or (impl == "auto" and gpu)  # noqa: E731
        return KernelPolicy(attention_kernels=wanted(self.attention_impl), gdn_kernels=wanted(self.gdn_impl),
                            fused_decode=self.fused_decode_kernels,
                            library_gemms_min_tokens=self.library_gemms_min_tokens, input_impl=self.input_impl)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
