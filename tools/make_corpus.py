#!/usr/bin/env python3
"""Build a small English demo corpus (JSONL) from the docstrings of the installed stdlib.

Why docstrings: every Python install carries a few megabytes of edited English prose, so the
demo can train a tokenizer and a tiny GPT without downloading anything. The output is
deterministic for a given Python installation: files are walked in sorted order and each
docstring is read with `ast` (no module is imported, so no side effects).

One JSON line per docstring that is long enough to be prose: {"text": ..., "source": ...}.

    python tools/make_corpus.py --output corpus.jsonl [--max-docs N] [--min-chars 100]

Exit 2 with one line when there is nothing to read (no such directory, no docstring).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import sysconfig
import time
import warnings
from pathlib import Path
from typing import Iterator

# Test suites and IDLE's tests are mostly one-line docstrings about test cases, not prose.
SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"}

DOCSTRING_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_files(stdlib_dir: Path) -> Iterator[Path]:
    """Yield the stdlib's .py files in sorted order, top-level names from sys.stdlib_module_names."""
    names = set(sys.stdlib_module_names)
    for entry in sorted(stdlib_dir.iterdir()):
        if entry.name.removesuffix(".py") not in names:
            continue
        if entry.is_file() and entry.suffix == ".py":
            yield entry
        elif entry.is_dir():
            for root, dirs, files in os.walk(entry):
                dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
                for name in sorted(files):
                    if name.endswith(".py"):
                        yield Path(root) / name


def docstrings(path: Path) -> Iterator[tuple[str, str]]:
    """Yield (qualified name, cleaned docstring) for the module and each class and function."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old modules
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return  # e.g. lib2to3 test data written in Python 2
    for node in ast.walk(tree):
        if isinstance(node, DOCSTRING_NODES):
            text = ast.get_docstring(node, clean=True)
            if text:
                yield getattr(node, "name", "<module>"), text


def corpus(stdlib_dir: Path, min_chars: int) -> Iterator[dict]:
    """Yield one record per prose-length docstring; identical docstrings are kept once."""
    seen: set[str] = set()
    for path in stdlib_files(stdlib_dir):
        rel = path.relative_to(stdlib_dir).as_posix()
        for name, text in docstrings(path):
            if len(text) < min_chars or text in seen:
                continue
            seen.add(text)
            yield {"text": text, "source": f"{rel}:{name}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--max-docs", type=int, default=None, help="stop after N documents")
    parser.add_argument("--min-chars", type=int, default=100,
                        help="skip docstrings shorter than this (default 100)")
    parser.add_argument("--stdlib-dir", default=sysconfig.get_paths()["stdlib"],
                        help="standard library directory (default: this interpreter's)")
    args = parser.parse_args(argv)
    if not Path(args.stdlib_dir).is_dir():
        print(f"make_corpus: --stdlib-dir {args.stdlib_dir} is not a directory", file=sys.stderr)
        return 2

    start = time.perf_counter()
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    count = chars = 0
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for record in corpus(Path(args.stdlib_dir), args.min_chars):
                if args.max_docs is not None and count >= args.max_docs:
                    break
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                count += 1
                chars += len(record["text"])
        if count:
            os.replace(tmp, out)  # never leave a half-written corpus under the real name
    finally:
        tmp.unlink(missing_ok=True)
    if not count:   # bad input, as for ptdp's commands: exit 2, one line
        print(f"make_corpus: no docstring of at least {args.min_chars} characters under "
              f"{args.stdlib_dir} (--stdlib-dir, --min-chars): nothing to write", file=sys.stderr)
        return 2
    print(f"wrote {count} documents ({chars / 1e6:.1f} M characters) to {out} "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
