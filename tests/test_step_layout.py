"""A step's host arrays (nothing compiled): scheduled rows flattened into a program's shape, the one-buffer
transfer, and the request's token slices the assembly copies from."""

import numpy as np
import pytest

from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.programs import StepShape
from jaxgdn.engine.request import Request, RequestMetrics, RowKind, SamplingParams
from jaxgdn.engine.scheduler import Scheduler
from jaxgdn.engine.state import NULL_PAGE
from jaxgdn.engine.step_layout import HOST_ONLY, BlockTables, StepArrays, build_step, pack_step_arrays, unpack_step_arrays

ECFG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, kv_page_size=4)


def scheduled_step():
    """One step of a fresh 6-token prompt (seeded) beside a decode row at position 5 (unseeded)."""
    s = Scheduler(ECFG, num_pages=16)
    dec = Request(0, [5, 6, 7, 8, 9], SamplingParams(temperature=0.5, max_tokens=4), RequestMetrics(0.0))
    s.add(dec)
    s.schedule()
    dec.num_computed, dec.output_token_ids = 5, [42]
    new = Request(1, [11, 12, 13, 14, 15, 16], SamplingParams(temperature=0, seed=3, max_tokens=4), RequestMetrics(0.0))
    s.add(new)
    out = s.schedule()
    assert [r.request for r in out.rows] == [dec, new]
    prefill_len = np.zeros(ECFG.num_slots, np.int32)
    for r in (dec, new):
        prefill_len[r.slot] = r.prefill_len
    return out.rows, dec, new, prefill_len


def test_rows_are_flattened_into_the_program_shape_with_padding_after():
    rows, dec, new, prefill_len = scheduled_step()
    tables = BlockTables(ECFG.num_slots, ECFG.max_pages_per_seq)
    a = build_step(rows, StepShape(16, 4), ECFG, prefill_len, tables, block_q=8)
    assert a.query_start_loc.tolist() == [0, 1, 7, 7, 7]
    assert a.token_row.tolist() == [0] + [1] * 6 + [-1] * 9
    assert a.positions[:7].tolist() == [5, 0, 1, 2, 3, 4, 5] and not a.positions[7:].any()
    # the host places prompt tokens only: the decode row's token (42) is placed on the device
    assert a.input_ids[:7].tolist() == [0, 11, 12, 13, 14, 15, 16] and not a.input_ids[7:].any()
    page = lambda req, pos: req.pages[pos // 4] * 4 + pos % 4  # noqa: E731
    assert a.kv_slots[:7].tolist() == [page(dec, 5)] + [page(new, p) for p in range(6)]
    assert np.all(a.kv_slots[7:] // 4 == NULL_PAGE)  # padding writes land in the null page
    assert a.idx_mapping.tolist() == [dec.slot, new.slot, 0, 0] and a.seq_lens.tolist() == [6, 6, 0, 0]
    assert np.all(a.block_tables[2:] == NULL_PAGE)
    assert a.block_tables[1, : len(new.pages)].tolist() == new.pages
    assert a.fresh.tolist() == [False, True, False, False] and a.samples.tolist() == [True, True, False, False]
    assert a.cu_num_logits.tolist() == [0, 1, 2, 2, 2]
    assert a.row_kind.tolist() == [int(RowKind.DECODE), int(RowKind.PREFILL_CHUNK), int(RowKind.PAD), int(RowKind.PAD)]
    # seeded noise depends on (seed, position) only; unseeded on the request id
    assert a.seeds[:2].tolist() == [0, 3] and a.request_ids[:2].tolist() == [dec.request_id + 1, 0]
    assert a.top_p[2:].tolist() == [1.0, 1.0]
    assert a.prefill_len[new.slot] == 6 and a.prefill_len[dec.slot] == 5


def test_a_step_larger_than_its_program_is_refused():
    rows, _, _, prefill_len = scheduled_step()
    tables = BlockTables(ECFG.num_slots, ECFG.max_pages_per_seq)
    with pytest.raises(ValueError, match="do not fit"):
        build_step(rows, StepShape(4, 4), ECFG, prefill_len, tables, block_q=8)  # 7 tokens
    with pytest.raises(ValueError, match="do not fit"):
        build_step(rows, StepShape(16, 1), ECFG, prefill_len, tables, block_q=8)  # 2 rows
    with pytest.raises(ValueError, match="do not fit"):
        build_step(rows, StepShape(8, 8, width=1), ECFG, prefill_len, tables, block_q=8)  # a uniform program


def test_step_arrays_travel_as_one_buffer_and_unpack_exactly():
    """The runner sends a step's host arrays as one int32 buffer; unpacking on device must give back
    every array with its shape, dtype and values (floats and uint32 bit-exact, bools as bools)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(3)
    fields = {name: rng.integers(-5, 9, (4, 3) if name == "block_tables" else 5).astype(np.int32)
              for name in StepArrays.__dataclass_fields__}
    fields.update(temperature=np.array([0.0, 0.7, 1e-30, -0.0, 3.5], np.float32),
                  top_p=np.array([1.0, 0.9, 0.5, 0.25, 1e-7], np.float32),
                  seeds=np.array([0, 1, 2**32 - 1, 2**31, 7], np.uint32), fresh=np.array([1, 0, 1, 1, 0], bool))
    arrays = StepArrays(**fields)
    buf, layout = pack_step_arrays(arrays)
    assert buf.dtype == np.int32 and buf.ndim == 1
    out = unpack_step_arrays(jnp.asarray(buf), layout)
    # host bookkeeping and the split launch's sampling extras stay on the host
    assert isinstance(out, StepArrays) and all(getattr(out, name) is None for name in HOST_ONLY)
    for name in fields.keys() - set(HOST_ONLY):
        value = getattr(out, name)
        assert value.dtype == fields[name].dtype and value.shape == fields[name].shape, name
        np.testing.assert_array_equal(np.asarray(value).view(np.uint8), fields[name].view(np.uint8), err_msg=name)


def test_request_token_slice_matches_the_concatenated_sequence():
    req = Request(0, [10, 11, 12], SamplingParams(), RequestMetrics(arrival_time=0.0))
    req.output_token_ids = [20, 21]
    full = req.prompt_token_ids + req.output_token_ids
    for a in range(6):
        for b in range(a, 7):
            assert req.token_slice(a, b) == full[a:b]
            got = req.token_array(a, b)  # the int32 form the step assembly copies from
            assert got.dtype == np.int32 and got.tolist() == full[a:b]
    assert [req.token_after(p) for p in range(5)] == full and req.token_after(5) == 0
    req.next_prompt_token = 13
    assert req.token_after(5) == 13
