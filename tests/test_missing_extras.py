"""A core install (`pip install -e .`, none of pyproject.toml's optional extras):

* a command that needs an extra it lacks stops in one line naming the package and the pip
  command, exit 2, no traceback, nothing written (the extras are hidden here by putting None in
  sys.modules, which makes `import NAME` fail as where it is not installed);
* the tests skip rather than fail: every use of an extra in tests/ is behind a skip
  (tests/optional.py), checked on the source.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from ptdp.cli import main
from tests.optional import EXTRA_OF


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


# --------------------------------------------------------------------------------------------
# The guard: every use of an extra in tests/ is behind a skip
# --------------------------------------------------------------------------------------------

TESTS = Path(__file__).resolve().parent
GUARDS = {"needs", "importorskip", "skip_without"}     # tests/optional.py, pytest's own
CALLS = {"preprocess": "datasets"}   # ptdp functions that import an extra (preprocess.py)
IMPLIED = {"transformers": {"tokenizers", "safetensors"}}   # transformers requires both


def _extra(module: str) -> str | None:
    return next((name for name in EXTRA_OF if module == name or module.startswith(f"{name}.")),
                None)


def _guarded(node: ast.AST) -> set[str]:
    """The extras a guard call under `node` skips without (`needs("datasets")`, ...)."""
    found = set()
    for sub in ast.walk(node):
        if (isinstance(sub, ast.Call) and getattr(sub.func, "attr", getattr(sub.func, "id", ""))
                in GUARDS and sub.args and isinstance(sub.args[0], ast.Constant)
                and (extra := _extra(str(sub.args[0].value)))):
            found |= {extra, *IMPLIED.get(extra, ())}
    return found


def _uses(node: ast.AST) -> list[str]:
    """The extras this one statement or expression node imports or calls into."""
    if isinstance(node, ast.Import):
        return [e for alias in node.names if (e := _extra(alias.name))]
    if isinstance(node, ast.ImportFrom):
        return [e] if (e := _extra(node.module or "")) else []
    if isinstance(node, ast.Call):
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        return [CALLS[name]] if name in CALLS else []
    return []


def unguarded_uses(source: str, where: str) -> list[str]:
    """'where:line extra' for each use of an extra not covered by a guard at module level or in
    an enclosing function; a helper (neither a test nor a fixture) may rely on its callers, if
    its module guards that extra somewhere."""
    tree = ast.parse(source)
    anywhere = _guarded(tree)
    found = []

    def visit(node: ast.AST, covered: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                helper = not child.name.startswith("test_") and not any(
                    "fixture" in ast.unparse(d) for d in child.decorator_list)
                visit(child, covered | _guarded(child) | (anywhere if helper else set()))
                continue
            found.extend(f"{where}:{child.lineno} {e}" for e in _uses(child) if e not in covered)
            visit(child, covered)

    top = ast.Module(body=[s for s in tree.body if not isinstance(
        s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))], type_ignores=[])
    visit(tree, _guarded(top))
    return found


def test_every_use_of_an_extra_in_the_tests_is_behind_a_skip():
    """A core install skips, never fails: each test module that imports an optional extra (or
    calls preprocess, which imports `datasets`) skips first (tests/optional.py). What ptdp's
    commands import is out of sight here: tests/test_missing_extras.py's command tests and a
    core-install run of the suite cover that."""
    words = [name.split(".")[0] for name in EXTRA_OF] + [f"{name}(" for name in CALLS]
    sources = {path: path.read_text() for path in sorted(TESTS.rglob("*.py"))}
    found = [use for path, text in sources.items() if any(w in text for w in words)
             for use in unguarded_uses(text, str(path.relative_to(TESTS)))]
    assert found == []


def test_the_guard_finds_an_unguarded_use():
    source = """import pytest
from tests.optional import needs

def helper():
    import wandb                               # 5: no guard for wandb in this module
    from datasets import load_dataset          # covered: test_one guards datasets

@pytest.fixture
def data():
    preprocess("c.jsonl")                      # 10: a fixture guards itself
    needs("transformers")
    import transformers, safetensors           # covered (transformers requires safetensors)

def test_one():
    needs("datasets")
    preprocess("c.jsonl")                      # covered
    import matplotlib.pyplot                   # 17
"""
    assert unguarded_uses(source, "m.py") == ["m.py:5 wandb", "m.py:10 datasets",
                                               "m.py:17 matplotlib"]


def test_ptdp_check_names_the_extra_for_a_tokenizers_file(monkeypatch):
    """`ptdp check` (before any rank starts) says which install reads a tokenizer.json."""
    import ptdp.checks
    from ptdp.checks import Findings, check_packages
    from ptdp.config import load_config
    monkeypatch.setattr(ptdp.checks, "package_installed", lambda name: name != "tokenizers")
    found = Findings()
    check_packages(load_config(None, ["data.tokenizer=tok/tokenizer.json"], world_size=1), found)
    assert found.errors == ["data.tokenizer needs the tokenizers package: pip install "
                            "'ptdp[hf]' (or pip install tokenizers)"]
