"""A seeded generator of GSM8K-style word problems with checkable answers, and its character tokenizer.

Each problem states a starting count, then 2-4 operations (buy/find: +, give/lose: -, double/triple: *,
share equally: /), then asks for the final count. The worked solution has one line per operation,
`<reason>, so <x><op><y>=<z>.`, and ends with GSM8K's `#### <answer>` line. Every number stays a
non-negative integer below 200.

Splits are disjoint by construction: a problem belongs to train / validation / test by a stable hash of
its question text (90 / 5 / 5 %), and each split's stream is generated from its own seed and filtered to
its bucket. The text format is GSM8K's few-shot format, `Question: ...\nAnswer: ...`.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import zlib
from pathlib import Path
from typing import Iterator

NAMES = ("Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivy", "Jon", "Kim", "Leo", "Mia", "Ned",
         "Ola", "Pam", "Raj", "Sam", "Tia", "Uma")
ITEMS = ("apples", "pens", "books", "coins", "cards", "shells", "stamps", "marbles", "eggs", "cups", "beads",
         "rocks")
SPLITS = {"train": (0, 90), "validation": (90, 95), "test": (95, 100)}  # hash bucket ranges (of 100)
SPLIT_SEEDS = {"train": 1, "validation": 2, "test": 3}
ANSWER_RE = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
MAX_VALUE = 199

PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"
SPECIAL_TOKENS = (PAD, EOS, UNK)  # ids 0, 1, 2
CHARSET = (" \n!\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~")


@dataclasses.dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # worked lines + "#### N"
    answer: int

    def prompt(self) -> str:
        """What the model is given: GSM8K's zero-shot format (few-shot prompts prepend solved examples)."""
        return format_prompt(self.question)

    def target(self) -> str:
        """What the model should generate after the prompt (eos is appended by the tokenizer step)."""
        return " " + self.solution


def format_prompt(question: str, shots: tuple[tuple[str, str], ...] = ()) -> str:
    """`Question: q\\nAnswer:`, after solved examples `Question: q\\nAnswer: a\\n\\n` for few-shot."""
    head = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in shots)
    return f"{head}Question: {question}\nAnswer:"


# The chat template of a checkpoint trained on this task (the server's /v1/chat/completions): a user message is a
# question, an assistant message a solved answer (few-shot), so a conversation renders as format_prompt would.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}Question: {{ m.content }}\nAnswer:"
    "{%- elif m.role == 'assistant' -%}{{ ' ' + m.content + '\\n\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def extract_answer(text: str) -> str | None:
    """The number after the first `####` (commas dropped), or None: GSM8K's strict match."""
    m = ANSWER_RE.search(text)
    return m.group(1).replace(",", "") if m else None


def multiple_choice(problem: Problem) -> tuple[list[str], int]:
    """The problem's worked solution against three whose last result and `####` answer are wrong (the right one
    at a place set by the question's hash), and the right one's index: the multiple-choice form, scored by
    loglikelihood."""
    a = problem.answer
    wrong = [d for d in (a + 1, a - 1, a + 10, a + 2, a + 3) if d >= 0][:3]
    head, _, _ = problem.solution.rpartition("\n####")
    tail = f"={a}."

    def with_answer(d: int) -> str:
        body = head[: head.rfind(tail)] + f"={d}." + head[head.rfind(tail) + len(tail):] if tail in head else head
        return f"{body}\n#### {d}"

    label = zlib.crc32(problem.question.encode()) % 4
    choices = [with_answer(d) for d in wrong]
    choices.insert(label, problem.solution)
    return choices, label


def _operation(rng: random.Random, name: str, item: str, x: int) -> tuple[str, str, int] | None:
    """One step on count x: (sentence, solution line, new count), or None if this pick does not fit x."""
    kind = rng.choice(("buy", "find", "give", "lose", "double", "triple", "share"))
    other = rng.choice([n for n in NAMES if n != name])
    if kind in ("buy", "find"):
        b = rng.randint(1, 40)
        y = x + b
        said = f"{name} buys {b} more {item}." if kind == "buy" else f"{name} finds {b} {item}."
        why = f"{name} {'buys' if kind == 'buy' else 'finds'} {b}, so {x}+{b}={y}."
    elif kind in ("give", "lose"):
        if x < 2:
            return None
        b = rng.randint(1, min(x - 1, 40))
        y = x - b
        said = f"{name} gives {b} {item} to {other}." if kind == "give" else f"{name} loses {b} {item}."
        why = f"{name} {'gives away' if kind == 'give' else 'loses'} {b}, so {x}-{b}={y}."
    elif kind in ("double", "triple"):
        k = 2 if kind == "double" else 3
        y = x * k
        if y > MAX_VALUE:
            return None
        said = f"Then the number of {item} {kind}s."
        why = f"It {kind}s, so {x}*{k}={y}."
    else:
        ks = [k for k in (2, 3, 4, 5) if x % k == 0 and x // k >= 1]
        if not ks:
            return None
        k = rng.choice(ks)
        y = x // k
        said = f"{name} shares the {item} equally among {k} friends and keeps one share."
        why = f"One of {k} equal shares is {x}/{k}={y}."
    if y > MAX_VALUE:
        return None
    return said, why, y


def make_problem(rng: random.Random) -> Problem:
    """One problem with 2-4 operations drawn from rng."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    x = rng.randint(2, 60)
    sentences, lines = [f"{name} has {x} {item}."], []
    steps = rng.randint(2, 4)
    while len(lines) < steps:
        op = _operation(rng, name, item, x)
        if op is None:
            continue
        said, why, x = op
        sentences.append(said)
        lines.append(why)
    sentences.append(f"How many {item} does {name} have now?")
    return Problem(question=" ".join(sentences), solution="\n".join(lines + [f"#### {x}"]), answer=x)


def split_of(question: str) -> str:
    bucket = zlib.crc32(question.encode()) % 100
    return next(s for s, (lo, hi) in SPLITS.items() if lo <= bucket < hi)


def problems(split: str, seed_offset: int = 0) -> Iterator[Problem]:
    """The split's endless deterministic stream (seed_offset picks another stream of the same split)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; one of {sorted(SPLITS)}")
    rng = random.Random(SPLIT_SEEDS[split] * 1_000_003 + seed_offset)
    while True:
        p = make_problem(rng)
        if split_of(p.question) == split:
            yield p


def take(split: str, n: int, seed_offset: int = 0) -> list[Problem]:
    """The first n problems of a split (the test split's first n is the evaluation set)."""
    it = problems(split, seed_offset)
    return [next(it) for _ in range(n)]


def load_jsonl(path: str | Path) -> list[Problem]:
    """GSM8K-format jsonl: one {"question": ..., "answer": "...\\n#### N"} per line."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ans = extract_answer(row["answer"])
            if ans is None:
                raise ValueError("answer has no '#### N' line")
            out.append(Problem(question=row["question"].strip(), solution=row["answer"].strip(), answer=int(float(ans))))
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"{path}:{i}: not a GSM8K row ({e})") from None
    return out


def build_tokenizer():
    """Character-level `tokenizers.Tokenizer`: ids 0..2 = pad, eos, unk, then CHARSET."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in CHARSET:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char a token
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def encode_example(tok, problem: Problem, eos_id: int) -> tuple[list[int], int]:
    """(prompt + target + eos ids, prompt length): the training sequence and where the answer starts."""
    prompt = tok.encode(problem.prompt()).ids
    target = tok.encode(problem.target()).ids
    return prompt + target + [eos_id], len(prompt)
