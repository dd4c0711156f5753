"""A Hugging Face tokenizer.json as ptdp's tokenizer: the factory picks it, its special tokens
take ptdp's roles, and it travels into checkpoints and back out to Hugging Face."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest

from tests.optional import needs
needs("tokenizers")
needs("transformers")

from ptdp.data.tokenizer import EOD, HFTokenizer, TokenizerError, load_tokenizer  # noqa: E402
from tests.hf.hf_models import BOS, EOS, hf_tokenizer  # noqa: E402

TEXTS = [f"Return item {i} of the sequence, or raise an error when it is empty." for i in range(50)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tok")
    hf_tokenizer(TEXTS, root, 300)
    return root


def test_the_factory_picks_by_file(tok_dir, tmp_path):
    assert isinstance(load_tokenizer(tok_dir), HFTokenizer)                    # a directory
    assert isinstance(load_tokenizer(tok_dir / "tokenizer.json"), HFTokenizer)
    with pytest.raises(TokenizerError, match="tokenizer model not found"):    # sentencepiece
        load_tokenizer(tmp_path / "missing.model")
    with pytest.raises(TokenizerError, match="is a directory without a tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"bad\.json: not a Hugging Face tokenizer\.json"):
        load_tokenizer(tmp_path / "bad.json")


def test_roles_encode_decode_and_pickling(tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    assert tok.vocab_size == 300
    assert tok.special_tokens() == {EOD: EOS, "<bos>": BOS}
    assert tok.eod_id == tok.special_ids()[EOD] and tok.bos_id != tok.eod_id
    with pytest.raises(TokenizerError, match="has no mask_token"):
        tok.mask_id
    ids = tok.encode(TEXTS[3])
    assert tok.eod_id not in ids and tok.bos_id not in ids   # no special tokens added
    assert tok.decode(ids) == TEXTS[3] and tok.decode([tok.bos_id] + ids + [tok.eod_id]) == TEXTS[3]
    assert tok.encode_batch(TEXTS[:3]) == [tok.encode(t) for t in TEXTS[:3]]
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(TEXTS[0]) == tok.encode(TEXTS[0]) and clone.fingerprint == tok.fingerprint
    # without tokenizer_config.json the roles come from the usual spellings; a config that
    # names another eos wins
    shutil.copyfile(tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    assert load_tokenizer(tmp_path).special_ids() == tok.special_ids()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": BOS,
                                                                "bos_token": None}))
    assert load_tokenizer(tmp_path).special_tokens() == {EOD: BOS}


def test_it_travels_into_a_checkpoint_and_back_out(tok_dir, tmp_path):
    import transformers
    from ptdp.checkpoint.save import save_full_state
    from ptdp.checks import Findings, check_tokenizer
    from ptdp.config import load_config
    from ptdp.hf.tokenizer import write_tokenizer
    from ptdp.inference.local_model import checkpoint_tokenizer, initial_state, read_full_state

    cfg = load_config(None, ["model.num_layers=1", "model.hidden_size=16", "model.num_heads=2",
                             "model.vocab_size=320", f"data.tokenizer={tok_dir}/tokenizer.json"])
    found = Findings()
    check_tokenizer(cfg, [], found)
    assert found.errors == []
    final = save_full_state(initial_state(cfg.model, 0), cfg, tmp_path / "ckpt")
    directory, meta, _ = read_full_state(final)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(meta["files"])
    assert "tokenizer.model" not in meta["files"]
    path = checkpoint_tokenizer(directory, {})      # its own copy, not the config's path
    assert path == str(directory / "tokenizer.json")
    # written back as it is; without a tokenizer_config.json one is made that names the roles
    (tmp_path / "lone").mkdir()
    shutil.copyfile(tok_dir / "tokenizer.json", tmp_path / "lone" / "tokenizer.json")
    write_tokenizer(tmp_path / "lone" / "tokenizer.json", tmp_path / "hf", "gpt", 64)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == \
        (tok_dir / "tokenizer.json").read_bytes()
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf.eos_token == EOS and hf.bos_token == BOS
    assert hf(TEXTS[0], add_special_tokens=False)["input_ids"] == load_tokenizer(tok_dir).encode(
        TEXTS[0])
