"""A bad line of a `ptdp preprocess` input is one error naming the file and the line (it used to
be a 70-line traceback from `datasets`, a TypeError, or a decode error naming neither)."""

from __future__ import annotations

import json

import pytest

from ptdp.cli import main
from tests.optional import needs

from .tiny_vocabs import TEXTS, write_gpt2_files

needs("datasets")   # the lines are checked as preprocess reads them (write_gpt2_files: tokenizers)

GOOD = json.dumps({"text": TEXTS[0]}) + "\n"


@pytest.mark.parametrize("bad, message", [
    (b'{"text": "unfinished\n', "c.jsonl:2: not a JSON object (Invalid control character at"),
    (b'{"text": 12345}\n', "c.jsonl:2: field 'text' is 12345, not text (a string or a list of "
                           "strings)"),
    (b'["text"]\n', "c.jsonl:2: a JSON list, not an object"),
    (b'{"text": "caf\xe9"}\n', "c.jsonl:2: not UTF-8 (byte 13 of the line: b'\\xe9')"),
])
def test_a_bad_line_is_one_error_naming_file_and_line(tmp_path, capsys, bad, message):
    write_gpt2_files(tmp_path)
    source = tmp_path / "c.jsonl"
    source.write_bytes(GOOD.encode() + bad + GOOD.encode())
    rc = main(["preprocess", "--workers", "1", "--quiet", "--input", str(source),
               "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer",
               "--vocab-file", str(tmp_path / "gpt2-vocab.json"),
               "--merge-file", str(tmp_path / "gpt2-merges.txt")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert f"{source.parent}/{message}" in err
    assert not list(tmp_path.glob("out*"))
