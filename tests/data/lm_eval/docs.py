"""Loaders for the tiny lm-eval tasks of tests/serve/test_lm_eval.py: the jsonl files next to this
one, read without the network or the HF datasets cache (lm-eval's ``custom_dataset`` hook)."""

import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}


def load_mc(**kwargs):
    return _load("mc.jsonl")


def load_ppl(**kwargs):
    return _load("ppl.jsonl")
