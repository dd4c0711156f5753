"""Bad inputs to `ptdp config from-megatron` end in one line and exit 2: conflicting flags
(--fp16 --bf16 used to write bf16 with fp16's loss scale, silently) and an --out that cannot
be written (it used to be a traceback)."""

from __future__ import annotations

import pytest

from ptdp.cli import main
from ptdp.megatron.translate import TranslationError, translate

ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2",
        "--seq-length", "32", "--micro-batch-size", "1", "--lr", "1e-4", "--train-iters", "10"]


def test_fp16_and_bf16_together_are_refused():
    with pytest.raises(TranslationError, match="--fp16 and --bf16 conflict"):
        translate(ARGS + ["--fp16", "--bf16"])


def test_from_megatron_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert main(["config", "from-megatron", "--", *ARGS, "--fp16", "--bf16"]) == 2
    assert capsys.readouterr().err == ("ptdp config from-megatron: --fp16 and --bf16 conflict: "
                                       "Megatron-LM refuses them together; keep one\n")
    out = tmp_path / "nowhere" / "x.yaml"
    assert main(["config", "from-megatron", "--out", str(out), "--", *ARGS]) == 2
    assert capsys.readouterr().err == (f"ptdp config from-megatron: cannot write --out {out}: "
                                       f"No such file or directory\n")
