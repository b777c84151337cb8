"""`KernelPolicy`: every kernel choice and threshold of a program, in one frozen object.

An engine builds it once from its EngineConfig (`EngineConfig.kernel_policy`) and passes it to its step
programs as a static argument; the dense model takes one too. Tests build the policy they want. Where a
kernel is chosen, its shape limits (power-of-two heads, tile sizes) are checked at the call site: the
policy says what is wanted, the kernel's `*_supports` what is possible, and the XLA form runs otherwise.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.decode_attention import DecodeAttentionLayout


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """attention_kernels: the attention layers' Pallas kernels (ragged paged attention, KV write, the prompt
      q/k/v kernel, the decode attention of uniform steps); else their XLA forms.
    gdn_kernels: the GDN layers' Pallas kernels (the ragged recurrence; the pooled conv and recurrence of
      uniform steps); else the XLA forms.
    fused_decode: uniform steps run the one-kernel forms between a layer's two products (the GDN mixer for
      mixer_rows rows, the decode attention for rows of at most decode_attention_max_queries tokens).
    decode_attention_layout: that kernel's program layout.
    pool_gates: with fused weights, the pool kernel forms g and beta from the projection's b and a columns.
    swiglu_min_tokens: an MLP over at least this many tokens computes SiLU(gate) * up in its gate/up product's
      Mosaic GPU kernel on a Hopper GPU (None: never); swiglu_small: the kernel's small form at the decode
      sizes it takes.
    post_scale_max_tokens: a product reading a folded norm of at most this many tokens scales its output rows
      by 1/rms (the scale joins the consumer's kernel) instead of scaling its input rows first.
    library_gemms_min_tokens: step programs of at least this many tokens compile their matrix products for
      cuBLAS(Lt) instead of XLA's Triton GEMMs (None: never); no effect off the GPU.
    input_impl: the input-assembly kernel: "xla", "pallas" or "triton".
    tp_axis: the mesh axis a step's heads, MLP columns and vocabulary are split over when it runs per shard
      under shard_map (`model/parallel.py`); None on one device.
    """

    attention_kernels: bool = False
    gdn_kernels: bool = False
    fused_decode: bool = True
    mixer_rows: tuple[int, int] = (6, 16)
    decode_attention_max_queries: int = 8
    decode_attention_layout: DecodeAttentionLayout = DecodeAttentionLayout()
    pool_gates: bool = True
    swiglu_min_tokens: int | None = 4096
    swiglu_small: bool = True
    post_scale_max_tokens: int = 1
    library_gemms_min_tokens: int | None = 1024
    input_impl: str = "xla"
    tp_axis: str | None = None

    def replace(self, **changes) -> "KernelPolicy":
        return dataclasses.replace(self, **changes)


DEFAULT_POLICY = KernelPolicy()
