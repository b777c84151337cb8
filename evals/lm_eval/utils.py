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
