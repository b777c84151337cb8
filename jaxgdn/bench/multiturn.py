"""`bench serve --dataset multiturn`: conversations whose every turn sends the whole conversation so far.

Each of --num-prompts conversations has --num-turns turns. Turn 1's prompt is a random message of --input-len
tokens; turn n+1's is turn n's prompt, turn n's output and a new message of --input-len tokens, sent when
turn n is done (as a chat client does). Outputs are --output-len tokens (ignore_eos). Served in-process on
`LLM`'s engine; the prefix cache resumes each turn after the previous one where it kept that state.
"""

from __future__ import annotations

import time

import numpy as np


def make_conversations(args, vocab: int) -> list[tuple[list[list[int]], list[int]]]:
    """[(the message of each turn, the max_tokens of each turn)] per conversation, from args.seed."""
    rng = np.random.default_rng(args.seed)
    lo, hi = args.input_len
    out_lo, out_hi = args.output_len
    return [([[int(t) for t in rng.integers(0, vocab, int(rng.integers(lo, hi + 1)))] for _ in range(args.num_turns)],
             [int(rng.integers(out_lo, out_hi + 1)) for _ in range(args.num_turns)]) for _ in range(args.num_prompts)]


def serve_conversations(llm, conversations, max_model_len: int) -> dict:
    """Serve every conversation's turns in order, all conversations at once; a turn that would pass max_model_len
    ends its conversation. Returns wall time, tokens, TTFT and TPOT percentiles (ms; no ITL) and the prefix cache's
    hit rate."""
    from ..engine.request import SamplingParams
    from .common import percentiles

    if llm.prefill_worker is not None:
        raise SystemExit("bench serve --dataset multiturn serves one engine (no --pd)")
    eng = llm.engine
    llm.reset_prefix_cache()
    before = llm.metrics()
    live: dict[int, tuple[int, int, list[int]]] = {}  # request id -> (conversation, turn, prompt)
    ttft, tpot, prompt_tokens, output_tokens, turns = [], [], 0, 0, 0

    def send(c: int, turn: int, prompt: list[int]) -> None:
        nonlocal prompt_tokens
        max_tokens = conversations[c][1][turn]
        if len(prompt) + max_tokens > max_model_len:
            return
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        live[eng.add_request(prompt, sp)] = (c, turn, prompt)
        prompt_tokens += len(prompt)

    t0 = time.perf_counter()
    for c, (messages, _) in enumerate(conversations):
        send(c, 0, messages[0])
    while live:
        eng.step() if eng.has_unfinished else eng.flush()
        for rid in [r for r in live if eng.requests[r].finish_reason is not None]:
            c, turn, prompt = live.pop(rid)
            out = eng.output(rid)
            eng.forget(rid)
            ttft.append(out.ttft * 1e3)
            if out.tpot is not None:
                tpot.append(out.tpot * 1e3)
            output_tokens += len(out.token_ids)
            turns += 1
            if turn + 1 < len(conversations[c][0]):
                send(c, turn + 1, prompt + out.token_ids + conversations[c][0][turn + 1])
    wall = time.perf_counter() - t0
    after = llm.metrics()
    looked_up = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    found = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return {"wall_s": wall, "requests": turns, "finished": turns, "errors": 0, "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "total_tokens_per_s": (prompt_tokens + output_tokens) / wall,
            "output_tokens_per_s": output_tokens / wall,
            "prefix_cache_hit_rate": found / looked_up if looked_up else None, "prefix_cache_hit_tokens": found,
            "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot), "itl_ms": percentiles([])}


def conversation_requests(conversations, max_model_len: int) -> list[tuple[list[int], int]]:
    """The turns as (prompt ids, max_tokens), with zeros where the outputs go (their lengths are max_tokens, as
    ignore_eos serves them): what the bound, and a peer that cannot hold conversations, are given."""
    requests = []
    for messages, outputs in conversations:
        prompt: list[int] = []
        for message, max_tokens in zip(messages, outputs):
            prompt = prompt + message
            if len(prompt) + max_tokens > max_model_len:
                break
            requests.append((prompt, max_tokens))
            prompt = prompt + [0] * max_tokens
    return requests
