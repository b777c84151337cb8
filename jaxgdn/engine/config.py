"""Engine configuration (names follow vLLM's engine arguments)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax.numpy as jnp

from ..model.policy import KernelPolicy

KERNEL_CHOICES = ("auto", "xla", "pallas")  # gdn_impl and attention_impl
INPUT_IMPLS = ("xla", "pallas", "triton")  # input_impl
LIBRARY_GEMMS_MIN_TOKENS = KernelPolicy().library_gemms_min_tokens


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine batches, caches and compiles. Each field's docstring is its help on the command lines
    (engine_args.py builds their flags from these fields)."""

    max_num_seqs: int = 256
    """Requests running at once (= persistent request slots; slot 0 is the null slot)."""
    max_num_batched_tokens: int = 4096
    """Token budget of one step (chunked prefill splits longer prompts); the largest step program's tokens."""
    max_model_len: int = 2048
    """Longest sequence (prompt + output) a request may reach."""
    kv_page_size: int = 16
    """Tokens per page of the paged KV pool."""
    num_kv_pages: int | None = None
    """KV pages (auto: planned from gpu_memory_utilization where the device reports its memory, else enough for
    every slot at max_model_len)."""
    gpu_memory_utilization: float = 0.9
    """The fraction of the device's memory the engine may use (vLLM's knob): the weights, the GDN slots, the
    largest step program's temporaries, and the KV pages, which get what remains."""
    enforce_eager: bool = False
    """Run exact shapes (no bucket padding); each new shape compiles once."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Weight and activation dtype; the GDN recurrent state is fp32."""
    input_impl: Literal["xla", "pallas", "triton"] = "xla"
    """The input-assembly kernel (pallas_kernels/input_assembly.py): xla, pallas (Triton through Pallas; interpret
    mode off the GPU) or triton (jax-triton, on a GPU)."""
    gdn_impl: Literal["auto", "xla", "pallas"] = "auto"
    """The GDN layers' kernels: auto (the Pallas kernels on a GPU, the XLA forms elsewhere), xla, or pallas (also
    off the GPU, in interpret mode: for tests)."""
    attention_impl: Literal["auto", "xla", "pallas"] = "auto"
    """The attention layers' kernels: auto, xla or pallas, as gdn_impl."""
    num_speculative_tokens: int = 0
    """K: MTP drafts verified per step, 0..3 (0: no speculative decoding)."""
    pd: bool = False
    """Run prefill and decode in separate workers with explicit state handoff (PD disaggregation)."""
    pad_prompt_tail: bool = True
    """Pad a 1-token prompt tail to 1+K placeholder drafts when other requests are running and no prefill is
    scheduled (vLLM #45237), keeping steps uniform."""
    reproduce_pd_mtp_bug: bool = False
    """Restore vLLM's pre-#47466 behaviour (unguarded last_sampled overwrite and the old spec-row rule
    num_computed >= num_prompt): wrong outputs under PD + MTP at concurrency > 1. For demonstrations and tests."""
    prefill_device: int | None = None
    """JAX device index of the PD prefill worker (auto: the default device)."""
    decode_device: int | None = None
    """JAX device index of the PD decode worker (auto: the default device)."""
    precompile: bool = True
    """LLM(...) compiles every step program of the engine before it serves, so traffic never waits on the
    compiler; off compiles each program when a step first needs it."""
    compilation_cache: bool = True
    """Keep compiled step programs on disk across runs (JAX's persistent compilation cache) in $JAXGDN_CACHE_DIR,
    default ~/.cache/jaxgdn/jax; a second start-up reloads instead of compiling."""
    async_scheduling: bool | None = None
    """Schedule and launch step n+1 before step n's tokens are back, so host work overlaps the device (vLLM's async
    scheduling); same outputs. With MTP drafts a verify launch is booked as if every draft were accepted and the
    next launch starts where the device's count says. auto: on wherever it can be (not with pd)."""
    decode_steps_per_launch: int | None = None
    """Run this many model steps in one launch of the device program when no waiting request could start and either
    every row is a plain decode (with async scheduling) or, with MTP and not pd, every row is a verify window;
    same outputs, the host's per-step work is paid once per launch. auto: 4 on a GPU, 1 elsewhere."""
    fold_norms: bool = True
    """Serve with each decoder layer's RMSNorm weights folded into the projections that read them, so a decode
    step's norms cost one kernel each instead of two. Same math; the rounding differs at the weight dtype's
    precision. Off serves the loaded weights' values exactly."""
    fused_decode_kernels: bool = True
    """Launches of several decode or verify steps run the layers' one-kernel forms (the GDN mixer, the decode
    attention) where the kernels run; off runs the chains they replace, e.g. to rule them out when chasing a
    problem."""
    library_gemms_min_tokens: int | None = dataclasses.field(default=LIBRARY_GEMMS_MIN_TOKENS,
                                                             metadata={"none": "off"})
    """Step programs of at least this many tokens compile their matrix products for cuBLAS(Lt) instead of XLA's
    Triton GEMMs, so XLA folds the residual adds into the products' epilogues; off: never. GPU only."""
    tensor_parallel_size: int = dataclasses.field(default=1, metadata={"aliases": ("-tp",)})
    """Devices each engine (each PD worker) splits the model's heads, MLP and vocabulary over; it must divide the
    model's head counts. A PD worker's devices are the consecutive ones from prefill_device / decode_device."""
    enable_prefix_caching: bool = True
    """Reuse the KV pages and GDN state of prefixes computed before (docs/prefix-caching.md); same outputs. A PD
    prefill worker caches; its decode worker imports every request's state and does not."""
    prefix_cache_state_interval: int = 256
    """GDN state snapshots are taken where a prompt's chunk ends at a multiple of this many tokens inside a prefix
    another request computed already, and at every 4th multiple elsewhere, besides where requests end; a multiple
    of kv_page_size. Smaller resumes closer to where prompts part, at the cost of more chunks and snapshots."""
    num_state_snapshots: int | None = None
    """GDN state snapshots the prefix cache keeps (auto: planned by the memory plan: a tenth of the KV pages' memory
    on a GPU, two per request slot elsewhere)."""

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
