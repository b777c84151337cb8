"""Input assembly kernel: numpy reference == XLA == Pallas (interpret on CPU), and the cases of docs/vllm-pd-mtp-gdn.md §3."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.input_assembly import combine_pallas, combine_reference, combine_xla

IMPLS = {"xla": combine_xla, "pallas": combine_pallas}
if jax.default_backend() == "gpu":
    from pallas_kernels.input_assembly import combine_triton

    IMPLS["triton"] = combine_triton


def random_batch(rng, K, num_slots=12, max_rows=8):
    """Rows of every kind: prefill chunks, final chunks, prompt tails (padded or not), decode, verify, pad."""
    R = int(rng.integers(1, max_rows + 1))
    slots = rng.permutation(np.arange(1, num_slots))[:R]
    prefill_len = rng.integers(1, 40, num_slots).astype(np.int32)
    prefill_len[0] = 0
    q_lens, seq_lens, n_logits = [], [], []
    for r in slots:
        kind = rng.integers(0, 5)
        N = int(prefill_len[r])
        if kind == 0:  # prefill chunk (not reaching the end)
            computed = int(rng.integers(0, N))
            q = int(rng.integers(1, N - computed + 1))
            nl = 1
        elif kind == 1:  # padded PD prompt tail: [x_N, -1 x K]
            computed, q, nl = N - 1, 1 + K, 1 + K
        elif kind == 2:  # unpadded prompt tail
            computed, q, nl = N - 1, 1, 1
        elif kind == 3:  # decode / spec verify
            computed = N + int(rng.integers(0, 20))
            nd = int(rng.integers(0, K + 1))
            q, nl = 1 + nd, 1 + nd
        else:  # padding row of a bucket: null slot, nothing
            computed, q, nl = 0, 0, 0
        q_lens.append(q)
        seq_lens.append(computed + q)
        n_logits.append(nl)
    idx = np.array([0 if nl == 0 else s for s, nl in zip(slots, n_logits)], np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(n_logits)]).astype(np.int32)
    T = int(qsl[-1]) + int(rng.integers(0, 4))  # plus bucket padding tokens
    ids = rng.integers(0, 1000, T).astype(np.int32)
    last = rng.integers(1000, 2000, num_slots).astype(np.int32)
    drafts = rng.integers(2000, 3000, (num_slots, K)).astype(np.int32)
    return (ids, idx, last, qsl, np.array(seq_lens, np.int32), prefill_len, drafts, cu), int(cu[-1]) + 2


@pytest.mark.parametrize("K", [0, 1, 3])
@pytest.mark.parametrize("unguarded", [False, True])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_implementations_agree_on_random_ragged_batches(K, unguarded, impl):
    rng = np.random.default_rng(K * 10 + unguarded)
    for _ in range(8):
        args, num_logits = random_batch(rng, K)
        ref_ids, ref_li = combine_reference(*args, num_logits=num_logits, unguarded=unguarded)
        ids, li = IMPLS[impl](*(jnp.asarray(a) for a in args), num_logits=num_logits, unguarded=unguarded)
        np.testing.assert_array_equal(np.asarray(ids), ref_ids)
        np.testing.assert_array_equal(np.asarray(li), ref_li)


def one_row(num_computed, q, n_logits, N, K=1, slot=3):
    """A batch with one row in `slot`; token ids = 100 + position, last_sampled = 7, drafts = 8.."""
    ids = np.array([100 + num_computed + i for i in range(q)], np.int32)
    prefill_len = np.zeros(5, np.int32)
    prefill_len[slot] = N
    last = np.full(5, 7, np.int32)
    drafts = np.tile(np.arange(8, 8 + K, dtype=np.int32), (5, 1))
    return (ids, np.array([slot], np.int32), last, np.array([0, q], np.int32),
            np.array([num_computed + q], np.int32), prefill_len, drafts, np.array([0, n_logits], np.int32))


@pytest.mark.parametrize("impl", ["reference"] + list(IMPLS))
def test_worked_cases_of_reference_section_3(impl):
    fn = combine_reference if impl == "reference" else IMPLS[impl]
    run = lambda args, unguarded=False: [np.asarray(x).tolist() for x in fn(*args, num_logits=args[-1][-1], unguarded=unguarded)]  # noqa: E731
    N, M = 10, 12
    # Normal spec decode: query [y, d] at positions M, M+1 -> [last_sampled, draft].
    assert run(one_row(M, 2, 2, N)) == [[7, 8], [0, 1]]
    # First decode after a local prefill: num_computed = N, one token -> last_sampled.
    assert run(one_row(N, 1, 1, N)) == [[7], [0]]
    # A prefill chunk and the last prefill chunk: untouched, logit at qe - 1.
    assert run(one_row(0, 4, 1, N)) == [[100, 101, 102, 103], [3]]
    assert run(one_row(6, 4, 1, N)) == [[106, 107, 108, 109], [3]]
    # PD GDN tail, padded [x_N, -1]: post-fix keeps x_N (position N-1) and places the draft.
    assert run(one_row(N - 1, 2, 2, N)) == [[109, 8], [0, 1]]
    # ... pre-fix overwrote x_N with last_sampled: the #47466 bug.
    assert run(one_row(N - 1, 2, 2, N), unguarded=True) == [[7, 8], [0, 1]]
    # Unpadded PD tail: seq_len == prefill_len, untouched by both versions.
    assert run(one_row(N - 1, 1, 1, N)) == run(one_row(N - 1, 1, 1, N), unguarded=True) == [[109], [0]]
