"""A command that needs an optional extra it lacks stops in one line naming the package and the
pip command, exit 2, no traceback, nothing written: the extras are hidden here by putting None in
sys.modules, which makes `import NAME` fail as on a core install (`pip install -e .`)."""

from __future__ import annotations

import json
import sys

import pytest

from ptdp.cli import main


def hide(monkeypatch, *packages: str) -> None:
    """`import PACKAGE` (and its submodules) raises ModuleNotFoundError until the test ends."""
    for package in packages:
        for name in [n for n in sys.modules if n.startswith(f"{package}.")] + [package]:
            monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A corpus, a tiny sentencepiece model (core), a GPT-2 vocabulary (read by `tokenizers`)
    and a metrics file."""
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("inputs")
    texts = [f"Document number {i} says hello to the world." for i in range(40)]
    (root / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    spm.SentencePieceTrainer.Train(sentence_iterator=iter(texts), model_prefix=str(root / "sp"),
                                   vocab_size=40, model_type="bpe", minloglevel=2)
    (root / "gpt2-vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
    (root / "gpt2-merges.txt").write_text("#version: 0.2\na b\n")
    (root / "m.jsonl").write_text("".join(json.dumps({"iter": i, "loss": 5.0 - i, "lr": 1e-3})
                                          + "\n" for i in range(1, 4)))
    return root


def one_line(capfd, rc: int) -> str:
    err = capfd.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("tokenizer, hidden, expect", [
    ("sp.model", "datasets",
     "error: `ptdp preprocess` needs Hugging Face datasets: pip install 'ptdp[data]' (or pip "
     "install datasets)"),
    ("gpt2-vocab.json", "tokenizers",
     "error: {root}/gpt2-vocab.json: reading a Hugging Face tokenizer or a GPT-2/WordPiece "
     "vocabulary needs the tokenizers package: pip install 'ptdp[hf]' (or pip install tokenizers)"),
], ids=["datasets", "tokenizers"])
def test_preprocess(inputs, tmp_path, capfd, monkeypatch, tokenizer, hidden, expect):
    hide(monkeypatch, hidden)
    rc = main(["preprocess", "--input", str(inputs / "c.jsonl"), "--tokenizer",
               str(inputs / tokenizer), "--output-prefix", str(tmp_path / "out"), "--quiet",
               "--workers", "1"])
    assert one_line(capfd, rc) == expect.format(root=inputs)
    assert list(tmp_path.iterdir()) == []


def test_plot(inputs, tmp_path, capfd, monkeypatch):
    hide(monkeypatch, "matplotlib")
    rc = main(["plot", str(inputs / "m.jsonl"), "--out", str(tmp_path / "curves.png")])
    assert one_line(capfd, rc) == "ptdp plot: matplotlib is not installed: pip install 'ptdp[plot]'"
    assert list(tmp_path.iterdir()) == []


def test_timeline(tmp_path, capfd, monkeypatch):
    hide(monkeypatch, "matplotlib")
    rc = main(["timeline", "--schedule", "1f1b", "--p", "2", "--m", "4", "--out",
               str(tmp_path / "t.png"), "--chrome", str(tmp_path / "t.json")])
    assert one_line(capfd, rc) == ("ptdp timeline: drawing needs matplotlib: pip install "
                                   "'ptdp[plot]'")
    assert list(tmp_path.iterdir()) == []
