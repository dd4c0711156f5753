"""`ptdp convert` both ways: HF logits equal ptdp's, round trips are bit-identical, a converted
checkpoint trains on.

One spawned job (world 4) trains a GPT under 2BW (weight-versioned checkpoint) and a BERT,
both with (p, t, d) = (2, 2, 1), converts them to Hugging Face and back on rank 0, then loads
the GPT's converted checkpoint into a (2, 2, 1) trainer and runs one more iteration. The
tokenizer's vocabulary (600) is not a multiple of 128 * t, so vocabulary padding is exercised.

The same job trains one iteration of a Llama converted from Hugging Face: a random
`LlamaForCausalLM` (GQA: 4 heads, 2 K/V heads; untied; Llama 3 rope scaling) with its own
byte-level BPE tokenizer.json, converted (before the job) into a (2, 2, 1) checkpoint, trained
on data tokenised with that tokenizer.json, and converted back (after it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.optional import needs
needs("transformers")
needs("google.protobuf")

from ptdp.cli import main  # noqa: E402
from ptdp.inference.local_model import LocalModel, read_full_state  # noqa: E402
from ptdp.runtime.local_ranks import run_on_ranks  # noqa: E402
from tests.data.conftest import load_make_corpus  # noqa: E402
from tests.deadline import within
from tests.hf.hf_models import (hf_tokenizer, logits_diff, random_hf_model,  # noqa: E402
                                released_configs, same_state)

VOCAB = 600
TINY = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=4", "model.seq_length=16",
        f"model.vocab_size={VOCAB}", "train.micro_batch_size=2", "train.global_batch_size=8",
        "train.iters=2", "train.timeout_s=60", "parallel.pipeline=2", "parallel.tensor=2",
        "log.progress=false"]
RUNS = {"gpt": ["model.arch=gpt", "schedule.name=2bw"], "bert": ["model.arch=bert"]}


LLAMA_VOCAB, HF_TOKENS = 320, 300   # the model's vocabulary is larger than its tokenizer's
LLAMA = dict(vocab_size=LLAMA_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
             rms_norm_eps=1e-5, tie_word_embeddings=False,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8})


def train_llama(root: Path) -> list[float]:
    """One iteration of the converted Llama on (2, 2, 1), on data made with its tokenizer.json."""
    from ptdp.config import load_config
    from ptdp.training import Trainer
    saved = root / "llama" / "iter_0000000" / "config.yaml"
    cfg = load_config(str(saved), ["train.iters=1", "train.timeout_s=60", "log.progress=false",
                                   f"checkpoint.load={root}/llama", "data.source=indexed",
                                   f"data.paths=[{root}/llama_data]",
                                   "train.micro_batch_size=2", "train.global_batch_size=8"],
                      world_size=4)
    assert cfg.data.tokenizer.endswith("tokenizer.json")
    return [r["loss"] for r in Trainer(cfg).train()]


def first_loss(checkpoint: Path) -> float:
    """The first loss of a (2, 2, 1) run continuing a checkpoint converted from HF."""
    from ptdp.config import load_config
    from ptdp.training import Trainer
    cfg = load_config(str(checkpoint / "iter_0000000" / "config.yaml"),
                      ["train.iters=1", "train.timeout_s=60", "log.progress=false",
                       f"checkpoint.load={checkpoint}"], world_size=4)
    return Trainer(cfg).train()[0]["loss"]


def job(root: str, tokenizer: str) -> dict:
    from ptdp.config import load_config
    from ptdp.hf.convert import from_hf, to_hf
    from ptdp.training import Trainer

    root, out = Path(root), {}
    out["llama losses"] = train_llama(root)
    out["family losses"] = {name: first_loss(root / name) for name in LOSS_FAMILIES}
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
    llama_from_hf(root, corpus)
    families_from_hf(root)
    out = run_on_ranks(4, job, str(root), tok.path, timeout_s=within(280))[0]
    return root, out, tok, corpus


# One per kind of block the first loss goes through (learned positions and tanh-GeLU; Gemma's
# norms, GeGLU and scaled embeddings; experts with a gated shared expert): a trainer each costs
# seconds, and the other families' logits are checked in one process (tests/hf/test_families.py).
LOSS_FAMILIES = ("gpt2", "gemma", "qwen2_moe")
FAMILY_RUN = ["parallel.tensor=2", "parallel.pipeline=2", "model.seq_length=16", "model.dropout=0",
              "model.attention_dropout=0",
              "train.micro_batch_size=2", "train.global_batch_size=4"]


def families_from_hf(root: Path) -> None:
    """hf_NAME: a random model of a released shape (tests/hf/hf_models.py); NAME: its
    (2, 2, 1) checkpoint, training on synthetic data at 16 tokens without dropout (GPT-2 has
    0.1), so that its first loss is a deterministic one."""
    from ptdp.hf.convert import from_hf
    for name in LOSS_FAMILIES:
        random_hf_model(released_configs()[name], root / f"hf_{name}", std=0.3)
        from_hf(root / f"hf_{name}", root / name, FAMILY_RUN)


def llama_from_hf(root: Path, corpus: Path) -> None:
    """hf_llama: a random LlamaForCausalLM with a tokenizer.json; llama: its (2, 2, 1)
    checkpoint; llama_data: the corpus tokenised with that tokenizer.json."""
    import transformers
    from ptdp.hf.convert import from_hf
    from tests.data.tokenised import write_tokenised   # preprocess's bytes, without `datasets`
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    hf_tokenizer(texts, root / "hf_llama", HF_TOKENS)
    random_hf_model(transformers.LlamaConfig(**LLAMA), root / "hf_llama")
    from_hf(root / "hf_llama", root / "llama", ["parallel.tensor=2", "parallel.pipeline=2"])
    write_tokenised(corpus, root / "hf_llama" / "tokenizer.json", root / "llama_data")


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


def test_llama_from_hf_trains_on_its_tokenizer_and_converts_back(converted, tmp_path):
    """HF Llama (GQA, untied, llama3 rope) -> (2, 2, 1) checkpoint: the same logits as
    transformers; one iteration trains on 4 ranks; back to HF bit for bit, tokenizer included."""
    import transformers
    from ptdp.data.tokenizer import HFTokenizer, load_tokenizer
    root, out, _, _ = converted
    losses = out["llama losses"]
    assert len(losses) == 1 and 0 < losses[0] < 2 * torch.log(torch.tensor(LLAMA_VOCAB)).item()
    directory, meta, _ = read_full_state(root / "llama")
    assert meta["layout"] == {"pipeline": 2, "tensor": 2, "data": 1, "chunks": 1}
    assert meta["model"]["num_kv_heads"] == 2 and meta["model"]["rope_scaling_factor"] == 8.0
    assert not meta["model"]["tie_embeddings"] and "output_layer.weight" in meta["params"]
    original = transformers.LlamaForCausalLM.from_pretrained(str(root / "hf_llama")).eval()
    ours = LocalModel.from_checkpoint(root / "llama")
    assert logits_diff(ours, original, LLAMA_VOCAB, 16) < 1e-5
    # the tokenizer travelled: the checkpoint holds it and names its end-of-text token <eod>
    tok = load_tokenizer(directory / "tokenizer.json")
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == HF_TOKENS
    assert tok.special_tokens()["<eod>"] == "<|end_of_text|>"
    # ... and back
    assert main(["convert", str(root / "llama"), "--to", "hf", str(tmp_path / "hf")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(back).__name__ == "LlamaForCausalLM"
    assert same_state(original.state_dict(), back.state_dict())
    # every end id: generation_config.json's (LlamaConfig's default 2), then the tokenizer's
    assert back.config.eos_token_id == [original.generation_config.eos_token_id, tok.eod_id]
    assert back.config.bos_token_id == tok.bos_id
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == \
        (root / "hf_llama" / "tokenizer.json").read_bytes()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf_tok.eos_token == "<|end_of_text|>"
    assert hf_tok("a test", add_special_tokens=False)["input_ids"] == tok.encode("a test")


def test_hf_tokenizer_of_a_sentencepiece_model_shares_its_fingerprint(converted):
    from ptdp.data.tokenizer import load_tokenizer
    root, _, tok, _ = converted
    hf = load_tokenizer(root / "hf_gpt")   # the directory: its tokenizer.json
    assert hf.fingerprint == tok.fingerprint and hf.special_ids() == tok.special_ids()
    text = "Return the number of items, or raise ValueError."
    assert hf.encode(text) == tok.encode(text) and hf.decode(hf.encode(text)) == text


@pytest.mark.parametrize("family", LOSS_FAMILIES)
def test_the_first_loss_after_conversion_is_transformers_loss(converted, family):
    """The first loss of the (2, 2) run from a converted model equals transformers' loss on the
    same tokens (the run's first global batch: synthetic samples 0..3)."""
    import transformers
    from ptdp.data.synthetic import SyntheticGPT
    from ptdp.inference.local_model import model_config
    root, out, _, _ = converted
    _, meta, _ = read_full_state(root / family)
    data = SyntheticGPT(model_config(meta), meta["config"]["train"]["seed"])
    samples = [data[i] for i in range(4)]
    tokens = torch.tensor(np.stack([s["tokens"] for s in samples]))
    labels = torch.tensor(np.stack([s["labels"] for s in samples]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(root / f"hf_{family}")).eval()
    with torch.no_grad():
        theirs = torch.nn.functional.cross_entropy(hf(tokens).logits.flatten(0, 1),
                                                   labels.flatten()).item()
    assert out["family losses"][family] == pytest.approx(theirs, rel=1e-5, abs=1e-6)
