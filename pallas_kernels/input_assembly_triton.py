"""jax-triton version of the input-assembly kernel (GPU only; needs triton and jax-triton).

Same semantics as `input_assembly.combine_reference`; one Triton program per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax_triton as jt
import triton
import triton.language as tl


@triton.jit
def _combine_kernel(idx_ptr, last_ptr, qsl_ptr, seq_ptr, plen_ptr, draft_ptr, cu_ptr, ids_in_ptr, li_in_ptr,
                    ids_ptr, li_ptr, K: tl.constexpr, KP: tl.constexpr, LP: tl.constexpr, UNGUARDED: tl.constexpr):
    b = tl.program_id(0)
    r = tl.load(idx_ptr + b)
    qe = tl.load(qsl_ptr + b + 1)
    cs = tl.load(cu_ptr + b)
    n_logits = tl.load(cu_ptr + b + 1) - cs
    n_draft = n_logits - 1
    start = qe - n_logits
    offs = tl.arange(0, LP)
    tl.store(li_ptr + cs + offs, start + offs, mask=offs < n_logits)
    seq_len = tl.load(seq_ptr + b)
    plen = tl.load(plen_ptr + r)
    beyond = (seq_len > plen) & (n_logits > 0)
    if UNGUARDED:
        write = beyond
    else:
        write = beyond & (seq_len - n_logits >= plen)
    tok = tl.load(last_ptr + r)
    tl.store(ids_ptr + start, tok, mask=write)
    if K > 0:
        ko = tl.arange(0, KP)
        d = tl.load(draft_ptr + r * K + ko, mask=ko < K, other=0)
        tl.store(ids_ptr + qe - n_draft + ko, d, mask=beyond & (ko < n_draft))


def combine_triton(input_ids, idx_mapping, last_sampled, query_start_loc, seq_lens, prefill_len,
                   draft_tokens, cu_num_logits, num_logits, unguarded=False):
    K = draft_tokens.shape[1]
    R = idx_mapping.shape[0]
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    ids_out, li_out = jt.triton_call(
        i32(idx_mapping), i32(last_sampled), i32(query_start_loc), i32(seq_lens), i32(prefill_len),
        i32(draft_tokens) if K else jnp.zeros((1,), jnp.int32), i32(cu_num_logits), i32(input_ids),
        jnp.zeros((num_logits,), jnp.int32),
        kernel=_combine_kernel,
        out_shape=(jax.ShapeDtypeStruct(input_ids.shape, jnp.int32), jax.ShapeDtypeStruct((num_logits,), jnp.int32)),
        grid=(R,),
        input_output_aliases={7: 0, 8: 1},
        K=K, KP=max(1, triton.next_power_of_2(max(K, 1))), LP=triton.next_power_of_2(K + 1), UNGUARDED=bool(unguarded),
    )
    return ids_out, li_out
