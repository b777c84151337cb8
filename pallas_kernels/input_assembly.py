"""Input assembly: the port of vLLM's `combine_sampled_and_draft_tokens`, with the #47466 guard.

One signature, four implementations (numpy reference, XLA, Pallas, jax-triton):

    input_ids       [T] int32   prompt tokens already placed by the host; other slots are filled here
    idx_mapping     [R] int32   row -> persistent request slot
    last_sampled    [S] int32   per slot: the last sampled token
    query_start_loc [R+1] int32 row b owns tokens [qsl[b], qsl[b+1])
    seq_lens        [R] int32   tokens of the row's sequence after this step (num_computed + query_len)
    prefill_len     [S] int32   per slot: tokens that are prompt (or recompute) tokens
    draft_tokens    [S, K] int32
    cu_num_logits   [R+1] int32 row b owns logits rows [cu[b], cu[b+1]) = 1 + its number of drafts
    num_logits      static      length of logits_indices (>= cu[R]; rows past cu[R] are 0)
    unguarded       static      True restores the pre-fix (buggy) unconditional write
    -> (input_ids [T], logits_indices [num_logits])

Per row: logits_indices[cu[b] + i] = qe - n_logits + i. If seq_len <= prefill_len the row is a prefill
chunk and nothing else happens. Otherwise drafts go to the last n_logits - 1 slots, and last_sampled goes
to slot qe - n_logits only if that slot's absolute position seq_len - n_logits is at or past prefill_len
(it is a generated token). Pre-fix, it was written unconditionally, which overwrote the prompt tail x_N
of a padded PD handoff row with a stale token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt  # masked load/store (Triton lowering; also interpret mode)

from .common import interpret_default


def combine_reference(input_ids, idx_mapping, last_sampled, query_start_loc, seq_lens, prefill_len,
                      draft_tokens, cu_num_logits, num_logits, unguarded=False):
    """Numpy reference: a plain loop over rows."""
    ids = np.array(input_ids, dtype=np.int32, copy=True)
    logits_indices = np.zeros(num_logits, np.int32)
    for b in range(len(idx_mapping)):
        r = int(idx_mapping[b])
        qe = int(query_start_loc[b + 1])
        n_logits = int(cu_num_logits[b + 1] - cu_num_logits[b])
        n_draft = n_logits - 1
        start = qe - n_logits
        for i in range(n_logits):
            logits_indices[cu_num_logits[b] + i] = start + i
        seq_len, plen = int(seq_lens[b]), int(prefill_len[r])
        if n_logits == 0 or seq_len <= plen:
            continue
        if unguarded or seq_len - n_logits >= plen:
            ids[start] = last_sampled[r]
        for j in range(n_draft):
            ids[qe - n_draft + j] = draft_tokens[r, j]
    return ids, logits_indices


@functools.partial(jax.jit, static_argnames=("num_logits", "unguarded"))
def combine_xla(input_ids, idx_mapping, last_sampled, query_start_loc, seq_lens, prefill_len,
                draft_tokens, cu_num_logits, num_logits, unguarded=False):
    """Vectorised jnp version (scatter over rows), for backends without a kernel."""
    R = idx_mapping.shape[0]
    K = draft_tokens.shape[1]
    qe = query_start_loc[1:]
    n_logits = cu_num_logits[1:] - cu_num_logits[:-1]
    start = qe - n_logits
    plen = prefill_len[idx_mapping]
    beyond_prompt = (seq_lens > plen) & (n_logits > 0)
    write_sampled = beyond_prompt & (unguarded | (seq_lens - n_logits >= plen))
    T = input_ids.shape[0]
    # Out-of-range targets (index T) are dropped by the scatter: that is how "no write" is spelled.
    ids = input_ids.at[jnp.where(write_sampled, start, T)].set(last_sampled[idx_mapping], mode="drop")
    if K:
        j = jnp.arange(K)[None, :]
        n_draft = (n_logits - 1)[:, None]
        pos = qe[:, None] - n_draft + j
        ok = beyond_prompt[:, None] & (j < n_draft)
        ids = ids.at[jnp.where(ok, pos, T)].set(draft_tokens[idx_mapping], mode="drop")
    # logits rows: row b's i-th logit row is cu[b] + i.
    rows = jnp.arange(num_logits)
    # compare_all: the default binary search is a while loop, which XLA's GPU runtime runs outside its
    # CUDA graphs with a host round trip per iteration; R is small, so compare every pair instead.
    owner = jnp.clip(jnp.searchsorted(cu_num_logits[1:], rows, side="right", method="compare_all"), 0, R - 1)
    in_use = rows < cu_num_logits[-1]
    logits_indices = jnp.where(in_use, start[owner] + rows - cu_num_logits[owner], 0)
    return ids, logits_indices.astype(jnp.int32)


def _pallas_kernel(idx_ref, last_ref, qsl_ref, seq_ref, plen_ref, draft_ref, cu_ref, ids_in_ref, li_in_ref,
                   ids_ref, li_ref, *, max_logits, num_drafts, unguarded):
    # Triton lowering wants power-of-two vector sizes: max_logits >= 1+K and the draft width are padded.
    del ids_in_ref, li_in_ref  # aliased to ids_ref / li_ref
    b = pl.program_id(0)
    r = idx_ref[b]
    qe = qsl_ref[b + 1]
    cs = cu_ref[b]
    n_logits = cu_ref[b + 1] - cs
    n_draft = n_logits - 1
    start = qe - n_logits
    offs = jnp.arange(max_logits, dtype=jnp.int32)
    plt.store(li_ref.at[pl.ds(cs, max_logits)], start + offs, mask=offs < n_logits)
    seq_len = seq_ref[b]
    plen = plen_ref[r]
    beyond_prompt = (seq_len > plen) & (n_logits > 0)
    write_sampled = beyond_prompt & (unguarded | (seq_len - n_logits >= plen))
    sampled = jnp.full((1,), last_ref[r], jnp.int32)
    plt.store(ids_ref.at[pl.ds(start, 1)], sampled, mask=jnp.full((1,), write_sampled))
    if num_drafts:
        KP = draft_ref.shape[1]
        k_offs = jnp.arange(KP, dtype=jnp.int32)
        drafts = plt.load(draft_ref.at[r, pl.ds(0, KP)])
        plt.store(ids_ref.at[pl.ds(qe - n_draft, KP)], drafts, mask=beyond_prompt & (k_offs < n_draft))


def combine_pallas(input_ids, idx_mapping, last_sampled, query_start_loc, seq_lens, prefill_len,
                   draft_tokens, cu_num_logits, num_logits, unguarded=False, interpret=None):
    """Pallas kernel, one program per row; interpret=True on CPU (the default off-GPU)."""
    interpret = interpret_default(interpret)
    K = draft_tokens.shape[1]
    T = input_ids.shape[0]
    R = idx_mapping.shape[0]
    LP = pl.next_power_of_2(K + 1)
    KP = pl.next_power_of_2(max(K, 1))
    # Masked stores of up to LP (KP) elements start inside the arrays; pad the outputs past their ends.
    pad = LP + KP
    ids_padded = jnp.concatenate([input_ids.astype(jnp.int32), jnp.zeros((pad,), jnp.int32)])
    li = jnp.zeros((num_logits + pad,), jnp.int32)
    drafts = jnp.zeros((last_sampled.shape[0], KP), jnp.int32)
    if K:
        drafts = drafts.at[:, :K].set(draft_tokens.astype(jnp.int32))
    kernel = functools.partial(_pallas_kernel, max_logits=LP, num_drafts=K, unguarded=unguarded)
    ids_out, li_out = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(ids_padded.shape, jnp.int32), jax.ShapeDtypeStruct(li.shape, jnp.int32)),
        grid=(R,),
        input_output_aliases={7: 0, 8: 1},
        interpret=interpret,
    )(idx_mapping.astype(jnp.int32), last_sampled.astype(jnp.int32), query_start_loc.astype(jnp.int32),
      seq_lens.astype(jnp.int32), prefill_len.astype(jnp.int32), drafts,
      cu_num_logits.astype(jnp.int32), ids_padded, li)
    return ids_out[:T], li_out[:num_logits]


def combine_triton(input_ids, idx_mapping, last_sampled, query_start_loc, seq_lens, prefill_len,
                   draft_tokens, cu_num_logits, num_logits, unguarded=False):
    """jax-triton kernel (GPU only); imported lazily so CPU installs need neither triton nor jax-triton."""
    from .input_assembly_triton import combine_triton as impl

    return impl(input_ids, idx_mapping, last_sampled, query_start_loc, seq_lens, prefill_len,
                draft_tokens, cu_num_logits, num_logits, unguarded)


IMPLEMENTATIONS = {"xla": combine_xla, "pallas": combine_pallas, "triton": combine_triton}


def combine_sampled_and_draft_tokens(*args, impl: str = "xla", **kwargs):
    """Dispatch by name: "xla" (default), "pallas", "triton"."""
    try:
        fn = IMPLEMENTATIONS[impl]
    except KeyError:
        raise ValueError(f"unknown input-assembly implementation {impl!r}; choose from {list(IMPLEMENTATIONS)}")
    return fn(*args, **kwargs)
