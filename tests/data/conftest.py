"""Shared fixtures: a small stdlib-docstring corpus, tokenizers trained on it, and its
preprocessed GPT and BERT datasets, built once per test session in a temporary directory (on a
core install too: no optional extra is needed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from ptdp.config import load_config
from ptdp.data.indexed import IndexedDatasetWriter

from .tokenised import write_tokenised

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 512


def load_make_corpus():
    spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "tools" / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="session")
def corpus(workdir) -> Path:
    path = workdir / "corpus.jsonl"
    assert load_make_corpus().main(["--output", str(path), "--max-docs", "400"]) == 0
    return path


@pytest.fixture(scope="session")
def tokenizer(workdir, corpus):
    from ptdp.data.tokenizer import train_tokenizer

    return train_tokenizer(corpus, workdir / "tok", VOCAB, "bpe")


@pytest.fixture(scope="session")
def gpt_prefix(workdir, corpus, tokenizer) -> str:
    """What `ptdp preprocess` makes of the corpus, written without `datasets` (tokenised.py)."""
    return write_tokenised(corpus, tokenizer.path, workdir / "gpt")


@pytest.fixture(scope="session")
def bert_prefix(workdir, corpus, tokenizer) -> str:
    """The same with --split-sentences."""
    return write_tokenised(corpus, tokenizer.path, workdir / "bert", sentences=True)


def write_counting_dataset(prefix, doc_sizes, vocab_size=1 << 20, meta=None) -> np.ndarray:
    """Documents whose tokens are their global positions 0, 1, 2, ...: every token says where
    it came from. Returns the document start offsets (plus the end)."""
    bounds = np.concatenate([[0], np.cumsum(doc_sizes)])
    with IndexedDatasetWriter(prefix, vocab_size, meta) as writer:
        for d in range(len(doc_sizes)):
            writer.add_document([np.arange(bounds[d], bounds[d + 1])])
    return bounds


def make_config(*overrides: str):
    return load_config(None, ["data.source=indexed", *overrides])
