"""Sequence length after a Hugging Face conversion: a rotary model records the longest position
it supports (model.max_position_embeddings), converts at a sensible model.seq_length (saying
so), and its checkpoint loads at any length up to that; a learned table is cut on request."""

from __future__ import annotations

import json

import pytest
import torch

from tests.optional import needs
transformers = needs("transformers")

from ptdp.checkpoint.layout import CheckpointError, check_model_config, read_metadata  # noqa: E402
from ptdp.cli import main  # noqa: E402
from ptdp.inference.local_model import LocalModel, model_config, read_full_state  # noqa: E402
from tests.hf.hf_models import logits_diff, random_hf_model  # noqa: E402

LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=2, max_position_embeddings=8192, bos_token_id=None,
             eos_token_id=None)
GPT2 = dict(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32,
            activation_function="gelu", bos_token_id=None, eos_token_id=None)


def _convert(tmp_path, capsys, *overrides):
    """`ptdp convert HF --from hf`: (exit code, stderr lines but the no-tokenizer note, out)."""
    out = tmp_path / "ckpt"
    capsys.readouterr()
    code = main(["convert", str(tmp_path / "hf"), "--from", "hf", "--out", str(out), *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    return code, [line for line in err if "has no tokenizer files" not in line], out


def test_a_rotary_model_converts_at_a_sensible_length_and_loads_up_to_its_own(tmp_path, capsys):
    """Mistral v0.1's shape: max_position_embeddings past the default length, a 4096 window."""
    random_hf_model(transformers.MistralConfig(**LLAMA, num_key_value_heads=1, sliding_window=4096),
                    tmp_path / "hf")
    code, err, out = _convert(tmp_path, capsys)
    assert code == 0 and err == [
        "ptdp convert: note: model.sliding_window=4096 >= model.seq_length=4096: every query "
        "already sees all the keys before it, so the window changes nothing at this length (it "
        "would past 4096 tokens)",
        "ptdp convert: note: model.seq_length=4096 (the model supports 8192 positions; give "
        "model.seq_length=N up to that to train longer sequences)"], err
    directory, meta, _ = read_full_state(out)
    assert (meta["model"]["seq_length"], meta["model"]["max_position_embeddings"]) == (4096, 8192)
    cfg = model_config(meta)
    for length in (128, 8192):   # shorter and longer than it was saved at: no table to differ
        check_model_config(read_metadata(directory),
                           model_config({"model": {**meta["model"], "seq_length": length}}),
                           directory)
    with pytest.raises(CheckpointError, match="model.seq_length=9000 is past the 8192 positions"):
        check_model_config(meta, model_config({"model": {**meta["model"], "seq_length": 9000,
                                                         "max_position_embeddings": None}}),
                           directory)
    assert cfg.max_positions == 8192
    assert main(["convert", str(out), "--to", "hf", str(tmp_path / "back")]) == 0
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["max_position_embeddings"] == 8192
    code, err, _ = _convert(tmp_path, capsys, "model.seq_length=9000")
    assert code == 2 and len(err) == 1 and "model.seq_length=9000 is past the 8192" in err[0], err


def test_a_learned_table_is_cut_to_the_length_asked_for(tmp_path, capsys):
    original = random_hf_model(transformers.GPT2Config(**GPT2), tmp_path / "hf")
    code, err, out = _convert(tmp_path, capsys, "model.seq_length=16")
    assert code == 0 and not any("model.seq_length" in line for line in err), err
    _, meta, state = read_full_state(out)
    assert meta["model"]["seq_length"] == 16 and state["embedding.position"].shape[0] == 16
    assert torch.equal(state["embedding.position"],
                       original.state_dict()["transformer.wpe.weight"][:16])
    assert logits_diff(LocalModel.from_checkpoint(out), original, 64, 16) < 1e-5
    for bad, message in (("model.seq_length=64", "model.seq_length=64: the Hugging Face model's "
                                                  "position table has 32 rows"),
                         ("model.num_layers=2", "model.num_layers=2: the Hugging Face model "
                                                "has 1; a conversion sets only")):
        code, err, _ = _convert(tmp_path, capsys, bad)
        assert code == 2 and len(err) == 1 and message in err[0], err
