"""Bad data is a data error (exit 2, never restarted), not a crash: a Megatron pair without
ptdp's sidecar whose token ids exceed model.vocab_size is refused by `ptdp check`, and, found
while training (the check bypassed here), ends `ptdp train` with exit 2 and one line naming the
file and the document, where it used to fail with an IndexError traceback per rank (restarted
MAX_RESTARTS times) or, with t = 2, train on silently dropped ids.
"""

from __future__ import annotations

import argparse
import io
import contextlib
from pathlib import Path

import numpy as np
import pytest

from ptdp.data.gpt_dataset import GPTDataset
from ptdp.data.indexed import IndexedDataset, IndexedDatasetWriter, TokenIdError, sidecar_path
from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within
from tests.equivalence import TINY

BAD_DOCUMENT = 3


def _megatron_pair(tmp_path: Path) -> str:
    """20 documents of 40 ids below 100, but document 3 holds id 150; no sidecar."""
    prefix = tmp_path / "corpus"
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, vocab_size=200) as writer:
        for doc in range(20):
            tokens = rng.integers(0, 100, size=40)
            if doc == BAD_DOCUMENT:
                tokens[17] = 150
            writer.add_document([tokens.tolist()])
    sidecar_path(prefix).unlink()   # as Megatron's preprocess_data.py leaves it
    return str(prefix)


def test_a_sample_with_an_id_beyond_the_vocabulary_names_file_and_document(tmp_path):
    prefix = _megatron_pair(tmp_path)
    indexed = IndexedDataset(prefix)
    dataset = GPTDataset(indexed, 0, 20, seq_length=16, seed=1, vocab_limit=100)
    with pytest.raises(TokenIdError) as caught:
        for i in range(len(dataset)):
            dataset[i]
    assert str(caught.value).startswith(f"{prefix}.bin: document {BAD_DOCUMENT} holds token id "
                                        f"150, outside model.vocab_size=100")
    unchecked = GPTDataset(indexed, 0, 20, seq_length=16, seed=1)
    assert len([unchecked[i] for i in range(len(unchecked))]) == len(dataset)


def test_ptdp_check_refuses_the_pair(tmp_path):
    from ptdp.checks import check_job
    prefix = _megatron_pair(tmp_path)
    found = check_job(None, TINY + ["data.source=indexed", f"data.paths=[{prefix}]"], 1)
    assert [line for line in found.errors if "token ids" in line] == [
        f"data.paths: {prefix}.bin holds token ids 0..150, outside model.vocab_size=100; set "
        f"model.vocab_size, or check that this is the data of this model's tokenizer"]
    told = check_job(None, TINY + ["data.source=indexed", f"data.paths=[{prefix}]",
                                   "model.vocab_size=151"], 1)
    assert not [line for line in told.errors if "token ids" in line]


def _train_past_the_check(prefix: str, exit_dir: str) -> dict:
    import os

    import ptdp.data.indexed
    from ptdp.commands import train
    ptdp.data.indexed.token_id_range = lambda header: (0, 0)   # as if `ptdp check` missed it
    os.environ["PTDP_EXIT_DIR"] = exit_dir
    args = argparse.Namespace(config=None, verbose=False, overrides=TINY + [
        "data.source=indexed", f"data.paths=[{prefix}]", "train.iters=20", "log.progress=false",
        "data.split=100,0,0"])
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = train.run(args)
    return {"code": code, "stderr": stderr.getvalue()}


def test_ptdp_train_ends_with_exit_2_and_one_line(tmp_path):
    prefix = _megatron_pair(tmp_path)
    exit_dir = tmp_path / "exits"
    exit_dir.mkdir()
    out = run_on_ranks(1, _train_past_the_check, prefix, str(exit_dir), timeout_s=within(300))[0]
    assert out["code"] == 2
    lines = [line for line in out["stderr"].splitlines() if "holds token id" in line]
    assert lines == [f"ptdp train: rank 0: {prefix}.bin: document {BAD_DOCUMENT} holds token "
                     f"id 150, outside model.vocab_size=100 (ids 0..99): the data was made with "
                     f"another tokenizer, or model.vocab_size is too small"]
    assert (exit_dir / "rank0").read_text() == "2\n"
