"""`ptdp convert` both ways: HF logits equal ptdp's, round trips are bit-identical, a converted
checkpoint trains on.

One spawned job (world 4) trains a GPT under 2BW (weight-versioned checkpoint) and a BERT,
both with (p, t, d) = (2, 2, 1), converts them to Hugging Face and back on rank 0, then loads
the GPT's converted checkpoint into a (2, 2, 1) trainer and runs one more iteration. The
tokenizer's vocabulary (600) is not a multiple of 128 * t, so vocabulary padding is exercised.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("google.protobuf")

from ptdp.inference.local_model import LocalModel, read_full_state  # noqa: E402
from ptdp.runtime.local_ranks import run_on_ranks  # noqa: E402
from tests.data.conftest import load_make_corpus  # noqa: E402

VOCAB = 600
TINY = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=4", "model.seq_length=16",
        f"model.vocab_size={VOCAB}", "train.micro_batch_size=2", "train.global_batch_size=8",
        "train.iters=2", "train.timeout_s=60", "parallel.pipeline=2", "parallel.tensor=2",
        "log.progress=false"]
RUNS = {"gpt": ["model.arch=gpt", "schedule.name=2bw"], "bert": ["model.arch=bert"]}


def job(root: str, tokenizer: str) -> dict:
    from ptdp.config import load_config
    from ptdp.hf.convert import from_hf, to_hf
    from ptdp.training import Trainer

    root, out = Path(root), {}
    for arch, extra in RUNS.items():
        cfg = load_config(None, TINY + extra + [f"checkpoint.dir={root}/{arch}",
                                               f"data.tokenizer={tokenizer}"], world_size=4)
        trainer = Trainer(cfg)
        trainer.train()
        out[f"{arch} weights"] = trainer.full_state()
        if dist.get_rank() == 0:
            to_hf(root / arch, root / f"hf_{arch}")
            from_hf(root / f"hf_{arch}", root / f"back_{arch}",
                    ["parallel.tensor=2", "parallel.pipeline=2"])
        dist.barrier()
    cfg = load_config(None, TINY + RUNS["gpt"][:1] + ["train.iters=3",
                                                      f"checkpoint.load={root}/back_gpt"],
                      world_size=4)
    resumed = Trainer(cfg)
    out["resumed iteration"] = resumed.iteration
    out["resumed weights"] = resumed.full_state()
    out["resumed losses"] = [r["loss"] for r in resumed.train()]
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from ptdp.data.tokenizer import train_tokenizer
    root = tmp_path_factory.mktemp("hf")
    corpus = root / "corpus.jsonl"
    assert load_make_corpus().main(["--output", str(corpus), "--max-docs", "300"]) == 0
    tok = train_tokenizer(corpus, root / "tok", VOCAB, "bpe")
    out = run_on_ranks(4, job, str(root), tok.path, timeout_s=280)[0]
    return root, out, tok, corpus


def _hf_model(path: Path):
    import transformers
    kind = json.loads((path / "config.json").read_text())["model_type"]
    cls = transformers.AutoModelForCausalLM if kind == "gpt2" else transformers.AutoModelForPreTraining
    return cls.from_pretrained(str(path)).eval()


def _bert_inputs():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (3, 16), generator=g)
    types = (torch.arange(16) >= 9).long().expand(3, 16).contiguous()
    pad = torch.ones(3, 16, dtype=torch.long)
    pad[0, 11:] = 0   # a padded sequence
    return tokens, types, pad


def _max_diff(ours: LocalModel, hf, arch: str) -> float:
    with torch.no_grad():
        if arch == "gpt":
            tokens = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))
            return (ours.logits(tokens) - hf(tokens).logits).abs().max().item()
        tokens, types, pad = _bert_inputs()
        got = hf(input_ids=tokens, token_type_ids=types, attention_mask=pad)
        lm = (ours.logits(tokens, types, pad) - got.prediction_logits)[pad.bool()]
        sop = ours.sentence_order_logits(tokens, types, pad) - got.seq_relationship_logits
        return max(lm.abs().max().item(), sop.abs().max().item())


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_checkpoint_reads_back_the_trained_weights(converted, arch):
    root, out, _, _ = converted
    _, _, state = read_full_state(root / arch)
    assert set(state) == set(out[f"{arch} weights"])
    for name, value in out[f"{arch} weights"].items():   # 2BW: the newest version, not the shadow
        assert torch.equal(state[name], value), name


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_hf_logits_equal_ptdp_logits(converted, arch):
    root, _, _, _ = converted
    hf = _hf_model(root / f"hf_{arch}")
    assert type(hf).__name__ == {"gpt": "GPT2LMHeadModel", "bert": "MegatronBertForPreTraining"}[arch]
    assert hf.config.vocab_size == VOCAB   # padding stripped
    assert _max_diff(LocalModel.from_checkpoint(root / arch), hf, arch) < 1e-4


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_round_trip_is_bit_identical_and_matches_hf(converted, arch):
    root, _, _, _ = converted
    _, meta, before = read_full_state(root / arch)
    back_dir, back_meta, after = read_full_state(root / f"back_{arch}")
    assert back_meta["layout"] == {"pipeline": 2, "tensor": 2, "data": 1, "chunks": 1}
    assert sorted(p.name for p in back_dir.glob("model_pp*")) == [
        f"model_pp00{p}_tp00{t}.pt" for p in (0, 1) for t in (0, 1)]
    assert set(before) == set(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    # the padded rows are re-added (zeros) in the shards: t=2 pads 600 to 768
    shard = torch.load(back_dir / "model_pp000_tp001.pt")
    assert shard["embedding.word.weight"]["value"].shape[0] == 384
    assert _max_diff(LocalModel.from_checkpoint(root / f"back_{arch}"),
                     _hf_model(root / f"hf_{arch}"), arch) < 1e-4


def test_converted_checkpoint_trains_on(converted):
    _, out, _, _ = converted
    assert out["resumed iteration"] == 0
    for name, value in out["gpt weights"].items():
        assert torch.equal(out["resumed weights"][name], value), name
    assert len(out["resumed losses"]) == 3 and all(l == l for l in out["resumed losses"])


def test_tokenizer_loads_alone_and_tokenizes_like_sentencepiece(converted):
    import transformers
    root, _, tok, corpus = converted
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()][:200]
    texts += ["  two  spaces ", "café ñ 日本語 🤖 ﬁ", "tabs\tand\nnewlines", "12345 6.7e-8", ""]
    for arch in ("gpt", "bert"):
        hf = transformers.AutoTokenizer.from_pretrained(str(root / f"hf_{arch}"))
        for text in texts:
            ids = tok.encode(text)
            assert hf(text, add_special_tokens=False)["input_ids"] == ids, text
            assert hf.decode(ids) == tok.decode(ids), text
    bert = transformers.AutoTokenizer.from_pretrained(str(root / "hf_bert"))
    pair = bert("first part", "second part")
    ids = tok.special_ids()
    assert pair["input_ids"][0] == ids["[CLS]"] and pair["input_ids"][-1] == ids["[SEP]"]
    assert pair["token_type_ids"][-1] == 1 and bert.mask_token_id == ids["[MASK]"]


def test_bad_layout_names_the_keys_before_writing(converted, capsys):
    from ptdp.cli import main
    root, _, _, _ = converted
    code = main(["convert", str(root / "hf_gpt"), "--from", "hf", "--out",
                 str(root / "bad"), "parallel.tensor=3"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "model.num_heads (4) must be divisible by parallel.tensor (3)" in err
    assert all(line.startswith("ptdp convert: ") for line in err.splitlines()), err
    assert not (root / "bad").exists() or not any((root / "bad").glob("iter_*"))


def test_command_line_both_ways_and_an_interleaved_layout(converted, tmp_path, capsys):
    """`ptdp convert` as a user types it; HF -> (p, t, v) = (2, 1, 2) puts layers 0, 2 on
    pipeline rank 0 and 1, 3 on rank 1, and reads back the same weights."""
    from ptdp.cli import main
    root, _, _, _ = converted
    assert main(["convert", str(root / "gpt"), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert "GPT2LMHeadModel" in capsys.readouterr().out
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "ptdp_tokenizer.model"} <= names
    assert main(["convert", str(tmp_path / "hf"), "--from", "hf", "--out", str(tmp_path / "v2"),
                 "parallel.pipeline=2", "parallel.chunks=2", "schedule.name=interleaved"]) == 0
    assert "(p, t, d, v) = (2, 1, 1, 2)" in capsys.readouterr().out
    _, meta, after = read_full_state(tmp_path / "v2")
    ranks = {i: meta["params"][f"layers.{i}.mlp.fc1.weight"]["pipeline_rank"] for i in range(4)}
    assert ranks == {0: 0, 1: 1, 2: 0, 3: 1}
    _, _, before = read_full_state(root / "gpt")
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert (tmp_path / "v2" / "iter_0000000" / "tokenizer.model").is_file()
