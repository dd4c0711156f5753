"""`ptdp convert`'s refusal of a source that does not exist: one line naming it and what to
give, before the converters import torch (seconds of a user's time), in every direction."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.deadline import within

# The command in a fresh interpreter; prints whether torch was imported by the time it ended.
RUN = ("import sys; from ptdp.cli import main; code = main(sys.argv[1:]); "
       "print('torch' in sys.modules); sys.exit(code)")


@pytest.mark.parametrize("args, what", [
    (["--from", "hf", "--out", "OUT"], "give a Hugging Face model directory"),
    (["--from", "megatron", "--out", "OUT"], "give a Megatron-LM checkpoint"),
    (["--to", "hf", "OUT"], "give a ptdp checkpoint"),
    (["--to", "megatron", "OUT"], "give a ptdp checkpoint"),
])
def test_a_missing_source_is_refused_in_one_line_before_torch(tmp_path, args, what):
    missing = tmp_path / "no-such-model"
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in args]
    run = subprocess.run([sys.executable, "-c", RUN, "convert", str(missing), *argv],
                         capture_output=True, text=True, timeout=within(60))
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith(f"ptdp convert: {missing} does not exist: {what}"), lines
    assert run.stdout.strip() == "False"   # torch never imported
    assert not (tmp_path / "out").exists()
