"""Data and scoring of the jaxgdn_arith lm-eval task: test.jsonl beside this file, jaxgdn.eval's strict match."""

import json
from pathlib import Path

from jaxgdn.eval import is_correct
from jaxgdn.task import extract_answer

DATA = Path(__file__).resolve().parent / "test.jsonl"


def load_dataset(**kwargs):
    import datasets

    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def process_results(doc: dict, results: list[str]) -> dict:
    return {"exact_match": float(is_correct(results[0], int(extract_answer(doc["answer"]))))}


def load_mc_dataset(**kwargs):
    """The multiple-choice form (jaxgdn.task.multiple_choice): each row's choices and the right one's index."""
    import datasets

    from jaxgdn.task import Problem, multiple_choice

    rows = []
    for line in DATA.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            choices, label = multiple_choice(Problem(row["question"], row["answer"], int(extract_answer(row["answer"]))))
            rows.append({**row, "choices": choices, "label": label})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
