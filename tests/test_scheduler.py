"""The scheduler on its own (host only, nothing compiled): chunked prefill under the token budget, FCFS
admission bounded by slots and pages, preemption of the newest request, row kinds, the PD prompt tail's
padding and the #47466 verify-path rule, and launches of several steps."""

from jaxgdn.engine.config import EngineConfig
from jaxgdn.engine.request import Request, RequestMetrics, RequestStatus, RowKind, SamplingParams
from jaxgdn.engine.scheduler import Scheduler, row_kind, runs_verify_path


def config(**kw) -> EngineConfig:
    return EngineConfig(**{**dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, kv_page_size=4), **kw})


def request(rid: int, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(temperature=0, max_tokens=max_tokens),
                   RequestMetrics(arrival_time=0.0))


def run_rows(out, sampled: int = 7) -> None:
    """What the engine does after a step: the rows' tokens are computed, sampling rows emit a token."""
    for row in out.rows:
        row.request.num_computed += row.num_tokens - len(row.spec_tokens)
        if row.samples:
            row.request.output_token_ids.append(sampled)


def test_chunked_prefill_fills_the_budget_and_later_requests_wait():
    s = Scheduler(config(), num_pages=64)
    a, b = request(0, 20), request(1, 5)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(r.request, r.num_tokens, r.kind, r.samples) for r in out.rows] == [(a, 16, RowKind.PREFILL_CHUNK, False)]
    assert list(s.waiting) == [b] and len(a.pages) == 4  # 16 positions of 4-token pages
    run_rows(out)
    out = s.schedule()  # a's last 4 prompt tokens, then b's whole prompt in the 12 left
    assert [(r.request, r.num_tokens, r.samples) for r in out.rows] == [(a, 4, True), (b, 5, True)]
    run_rows(out)
    out = s.schedule()
    assert [(r.request, r.num_tokens, r.kind) for r in out.rows] == [(a, 1, RowKind.DECODE), (b, 1, RowKind.DECODE)]


def test_admission_is_first_come_first_served_and_bounded_by_slots():
    s = Scheduler(config(max_num_seqs=2), num_pages=64)
    reqs = [request(i, 3) for i in range(3)]
    for r in reqs:
        s.add(r)
    out = s.schedule()
    assert [r.request for r in out.rows] == reqs[:2] and list(s.waiting) == reqs[2:]
    assert sorted(r.slot for r in reqs[:2]) == [1, 2]  # slot 0 is the null slot
    s.finish(reqs[0], "stop")
    assert reqs[0].slot == 0 and reqs[0].pages == []
    run_rows(out)
    out = s.schedule()
    assert reqs[2] in [r.request for r in out.rows] and reqs[2].slot == 1  # the freed slot


def test_a_full_pool_preempts_the_newest_request_which_recomputes_first():
    s = Scheduler(config(), num_pages=5)  # 4 usable pages of 4 tokens
    a, b = request(0, 8), request(1, 8)
    s.add(a)
    s.add(b)
    run_rows(s.schedule())  # both prompts: 2 pages each, one output each
    assert s.pages.num_free == 0
    out = s.schedule()  # a's decode needs a third page: b, the newest, is preempted for it
    assert out.preempted == [b] and [r.request for r in out.rows] == [a]
    assert b.status is RequestStatus.WAITING and b.pages == [] and b.slot == 0 and b.num_computed == 0
    assert b.prefill_len == 9 and b.metrics.num_preemptions == 1  # prompt + its output are recomputed
    assert list(s.waiting) == [b]


def test_row_kinds_follow_request_state():
    r = request(0, 5)
    assert row_kind(r) is RowKind.PREFILL_CHUNK
    r.num_computed = 4  # one prompt token left: the tail a PD decode worker runs
    assert row_kind(r) is RowKind.PROMPT_TAIL
    r.num_computed = 5
    r.output_token_ids = [9]
    assert row_kind(r) is RowKind.DECODE
    r.spec_token_ids = [3, 4]
    assert row_kind(r) is RowKind.SPEC_VERIFY


def test_a_pd_prompt_tail_is_padded_with_placeholders_and_verified_only_under_the_fix():
    """Beside a running request and no prefill, an imported prompt tail (num_computed = N-1) becomes a window
    of 1+K: x_N and K placeholders. Fixed: it takes the verify path (its placeholders never reach the committed
    state). Pre-#47466 rule: it needs num_computed >= N, so it took the prefill path."""
    s = Scheduler(config(num_speculative_tokens=2), num_pages=64)
    running = request(0, 3)
    s.add(running)
    run_rows(s.schedule())
    tail = request(1, 6)
    tail.num_computed = 5  # a handoff imported the first N-1 tokens
    s.add(tail)
    row = s.schedule().rows[1]
    assert (row.request, row.kind, row.num_tokens, row.spec_tokens, row.padded_tail) == (
        tail, RowKind.PROMPT_TAIL, 3, [-1, -1], True)
    assert runs_verify_path(row, reproduce_pd_mtp_bug=False)
    assert not runs_verify_path(row, reproduce_pd_mtp_bug=True)


def test_a_prompt_tail_beside_a_prefill_chunk_runs_alone_unpadded():
    s = Scheduler(config(num_speculative_tokens=2), num_pages=64)
    chunk, tail = request(0, 10), request(1, 6)
    tail.num_computed = 5
    s.add(chunk)
    s.add(tail)
    rows = s.schedule().rows
    assert [(r.kind, r.num_tokens, r.spec_tokens) for r in rows] == [(RowKind.PREFILL_CHUNK, 10, []),
                                                                      (RowKind.PROMPT_TAIL, 1, [])]
    assert not any(runs_verify_path(r, False) or runs_verify_path(r, True) for r in rows)


def test_a_launch_runs_several_decode_steps_only_when_nothing_could_start():
    s = Scheduler(config(), num_pages=64)
    long, short = request(0, 3, max_tokens=20), request(1, 3, max_tokens=3)
    s.add(long)
    s.add(short)
    run_rows(s.schedule())
    out = s.schedule()
    free = s.pages.num_free
    assert s.launch_steps(out, 4) == 4
    assert [(r.launch_steps, r.token_budget) for r in out.rows] == [(4, 4), (2, 2)]  # short has 2 tokens left
    assert free - s.pages.num_free == 2  # long writes positions 3..6, short 3..4: both reach a second page
    s.add(request(2, 3))  # a waiting request that could start: one step, so it starts next
    assert s.launch_steps(s.schedule(), 4) == 1
