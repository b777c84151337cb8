"""`bench serve --pd`: what the PD handoffs of a run cost (bytes, the host's dispatch per handoff, the device's copy)."""

from __future__ import annotations

import time

import numpy as np

from .common import percentiles


def handoff_stats(llm, nbytes: list[int]) -> dict:
    """PD: the handoffs of a run: count, bytes per request, and the host's ms per request for each copy kind (the
    dispatch of an in-process transfer, an import or an export; the device runs them behind the steps)."""
    seconds: dict[str, list[float]] = {}
    for e in llm.engines:
        for kind, s in e.copies.handoff_seconds:
            seconds.setdefault(kind, []).append(s * 1e3)
    return {"count": len(nbytes), "bytes": percentiles(nbytes),
            **{f"{kind}_ms": percentiles(v) for kind, v in sorted(seconds.items())}}


def handoff_device_ms(llm, length: int, repeats: int = 20) -> dict:
    """PD: device ms of one handoff of a `length`-token prompt, copied from the prefill worker's pools into free
    pages and a free slot of the decode worker's, replayed `repeats` times and synchronised (an idle engine pair)."""
    import jax

    from ..engine.request import SamplingParams
    from ..engine.state_copies import HandoffImport, HandoffTransfer

    prefill, eng = llm.prefill_worker, llm.engine
    rng = np.random.default_rng(length)
    prefill.role.submit([int(t) for t in rng.integers(0, llm.model_config.vocab_size, length)],
                   SamplingParams(temperature=0, max_tokens=1))
    while prefill.has_unfinished:
        prefill.step()
    (h,) = prefill.role.pop_handoffs()
    n = h.num_pages(eng.ecfg.kv_page_size)
    (slot,), pages = eng.scheduler.slots.allocate(1), eng.scheduler.pages.allocate(n)
    try:
        parked = h.source
        if eng.source is not None:
            op = HandoffTransfer(prefill.runner, parked.request.slot, tuple(parked.request.pages[:n]), slot,
                                 tuple(pages), h.num_computed)
        else:
            h.export()
            op = HandoffImport(eng.copies.stage(h.arrays, n), slot, tuple(pages), h.num_computed)
        times = []
        for _ in range(repeats + 2):
            jax.block_until_ready(eng.runner.state)
            t0 = time.perf_counter()
            eng.runner.state = eng.copies.run(eng.runner.state, [op])
            jax.block_until_ready(eng.runner.state)
            times.append((time.perf_counter() - t0) * 1e3)
        return {"prompt_len": length, "bytes": h.nbytes, "kind": type(op).__name__, **percentiles(times[2:])}
    finally:
        eng.scheduler.slots.free([slot])
        eng.scheduler.pages.free(pages)
        if h.source is not None:
            h.source.release()


def print_ratio(pd: dict, colocated: dict) -> float:
    """Print the PD process's warm run against the colocated one's; returns PD's wall over colocated's."""
    w, c, hs = pd["warm"], colocated["warm"], pd["warm"]["handoffs"]
    ms = lambda kind: "-" if not hs.get(kind) else f"{hs[kind]['p50']:.3f} / {hs[kind]['p99']:.3f}"  # noqa: E731
    ratio = w["wall_s"] / c["wall_s"]
    print(f"PD warm {w['wall_s']:.2f} s vs colocated {c['wall_s']:.2f} s: {ratio:.2f}x the wall, "
          f"{w['total_tokens_per_s'] / c['total_tokens_per_s']:.2f}x the tokens/s; {hs['count']} handoffs of "
          f"{hs['bytes']['p50'] / 1e6:.2f} MB median, host ms per handoff p50 / p99: transfer {ms('transfer_ms')}, "
          f"import {ms('import_ms')}, export {ms('export_ms')}; device ms "
          + ", ".join(f"{d['prompt_len']} tokens {d['p50']:.3f}" for d in pd["handoff_device_ms"]), flush=True)
    return ratio
