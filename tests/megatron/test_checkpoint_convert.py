"""`ptdp convert --from megatron` / `--to megatron` against checkpoints megatron-core writes.

One module-scoped fixture builds a tiny megatron-core GPT (Llama-style: rotary positions,
RMSNorm, SwiGLU, grouped-query attention, untied output) and a tiny BERT on CPU and saves
each in Megatron-LM's legacy layout and with `dist_checkpointing.save` (torch_dist). The
tests convert them, compare ptdp's logits with megatron-core's forward on the same tokens,
go back to Megatron (loaded by megatron-core's own `load_state_dict`, strict) and train on.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from ptdp.inference.local_model import LocalModel, read_full_state  # noqa: E402
from tests.megatron import mcore_models as mc, megatron_lm  # noqa: E402

TOKENS = torch.randint(0, mc.VOCAB, (2, mc.SEQ), generator=torch.Generator().manual_seed(0))
TYPES = torch.cat([torch.zeros(2, mc.SEQ // 2), torch.ones(2, mc.SEQ // 2)], 1).long()


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """Both models, their reference logits and their checkpoints in both formats; megatron-core
    stays set up on CPU (a 1-rank gloo group) for the module's tests."""
    root = tmp_path_factory.mktemp("megatron")
    with pytest.MonkeyPatch.context() as mp, mc.cpu_megatron(mp):
        gpt_args, bert_args = mc.gpt_args(), mc.bert_args()
        gpt, bert = mc.build_gpt(gpt_args), mc.build_bert(bert_args)
        out = {"gpt": gpt, "bert": bert, "gpt_args": gpt_args, "root": root,
               "gpt_logits": mc.gpt_logits(gpt, TOKENS),
               "bert_logits": mc.bert_logits(bert, TOKENS, TYPES)}
        mc.save_legacy(gpt, gpt_args, root / "gpt_legacy", 100)
        mc.save_torch_dist(gpt, gpt_args, root / "gpt_dist", 100)
        mc.save_legacy(bert, bert_args, root / "bert_legacy", 5)
        mc.save_torch_dist(bert, bert_args, root / "bert_dist", 5)
        yield out


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_gpt_logits_equal_megatron_core(megatron, fmt, tmp_path):
    from ptdp.megatron.checkpoint import from_megatron
    final, cfg, found = from_megatron(megatron["root"] / f"gpt_{fmt}", tmp_path / "ptdp",
                                      ["parallel.tensor=2", "parallel.pipeline=2"])
    assert found["format"] == {"legacy": "legacy", "dist": "torch_dist"}[fmt]
    assert final.name == "iter_0000100" and cfg.model.num_kv_heads == 2
    assert (cfg.model.activation, cfg.model.normalization, cfg.model.tie_embeddings) == \
        ("swiglu", "rmsnorm", False)
    model = LocalModel.from_checkpoint(tmp_path / "ptdp")
    _close(model.logits(TOKENS), megatron["gpt_logits"])


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_bert_logits_equal_megatron_core(megatron, fmt, tmp_path):
    from ptdp.megatron.checkpoint import from_megatron
    from_megatron(megatron["root"] / f"bert_{fmt}", tmp_path / "ptdp")
    model = LocalModel.from_checkpoint(tmp_path / "ptdp")
    lm, binary = megatron["bert_logits"]
    keep = torch.ones_like(TOKENS)
    _close(model.logits(TOKENS, TYPES, keep), lm)
    _close(model.sentence_order_logits(TOKENS, TYPES, keep), binary)


def _megatron_split(full: dict, args, tensor: int, pipeline: int) -> dict:
    """What rank (t, p) of a Megatron-LM job with this split saves, built from megatron-core's
    (1, 1) state dict by megatron-core's own rules, independently of ptdp/megatron:
    ColumnParallelLinear and the vocab-parallel tables keep rows [t*n/T, (t+1)*n/T)
    (output_size_per_partition), RowParallelLinear the same columns; a gated fc1's rank output
    is chunked into (gate, up) by MLP.forward, so rank t holds [gate rows of t; up rows of t];
    norms and row-parallel biases are replicated; stage p holds layers [p*L/P, (p+1)*L/P)
    renamed from 0, the embedding on stage 0 and the head on stage P-1."""
    column = ("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight",
              "output_layer.weight")
    per_stage = args.num_layers // pipeline
    out = {(t, p): {} for t in range(tensor) for p in range(pipeline)}
    for name, value in full.items():
        if value is None:
            continue
        parts = name.split(".")
        if parts[1] == "layers":
            index = int(parts[2])
            stage, parts[2] = index // per_stage, str(index % per_stage)
        else:
            stage = 0 if name.startswith("embedding.") else pipeline - 1
        for t in range(tensor):
            if "linear_fc1" in name and args.swiglu:
                gate, up = value.chunk(2)
                shard = torch.cat([gate.chunk(tensor)[t], up.chunk(tensor)[t]])
            elif name.endswith(column):
                shard = value.chunk(tensor, 0)[t]
            elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                shard = value.chunk(tensor, 1)[t]
            else:
                shard = value
            out[t, stage][".".join(parts)] = shard.clone()
    return out


def _save_split(shards: dict, args, directory, virtual: bool) -> None:
    """Rank (t, p)'s state dict as Megatron-LM saves it; `virtual`: the two stages are instead
    the virtual chunks 'model0', 'model1' of one pipeline rank (with one pipeline rank and two
    chunks of one layer each, chunk k holds what stage k of two does)."""
    for t in range(args.tensor_model_parallel_size):
        if virtual:
            saved = {f"model{k}": shards[t, k] for k in range(2)}
            files = {f"mp_rank_{t:02d}": saved}
        else:
            files = {f"mp_rank_{t:02d}_{p:03d}": {"model": shards[t, p]} for p in range(2)}
        for name, saved in files.items():
            (directory / name).mkdir(parents=True)
            torch.save(dict(saved, args=args, iteration=7, checkpoint_version=3.0),
                       directory / name / "model_optim_rng.pt")


@pytest.mark.parametrize("virtual", [False, True])
def test_legacy_tensor_and_pipeline_split_reads_as_the_whole_model(megatron, virtual, tmp_path):
    """(tensor 2, pipeline 2) and (tensor 2, 1 pipeline rank x 2 virtual chunks) legacy
    checkpoints convert to the same weights as the (1, 1) one, bit for bit."""
    from ptdp.megatron.checkpoint import read_megatron
    args = mc.gpt_args(tensor_model_parallel_size=2, pipeline_model_parallel_size=2 - virtual,
                       virtual_pipeline_model_parallel_size=2 if virtual else None)
    shards = _megatron_split(megatron["gpt"].state_dict(), args, 2, 2)
    _save_split(shards, args, tmp_path / "iter_0000007", virtual)
    whole = read_megatron(megatron["root"] / "gpt_legacy")["state"]
    split = read_megatron(tmp_path / "iter_0000007")
    assert split["iteration"] == 7 and split["format"] == "legacy"
    assert split["state"].keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(split["state"][name], value), name


def test_virtual_pipeline_layer_offsets_are_megatron_cores(megatron):
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from ptdp.megatron.legacy import layer_offset
    config = mc.transformer_config(mc.gpt_args(num_layers=8))   # megatron's state is set up
    config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size = 2, 2
    for rank in range(2):
        for chunk in range(2):
            assert layer_offset(8, 2, 2, rank, chunk) == get_transformer_layer_offset(
                config, vp_stage=chunk, pp_rank=rank)


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_to_megatron_loads_in_megatron_core(megatron, arch, tmp_path):
    """ptdp -> Megatron with the local spec's names, legacy and torch_dist: megatron-core
    loads each strictly (`load_state_dict`, `dist_checkpointing.load`) and computes the same
    logits as the model the ptdp checkpoint came from."""
    from megatron.core import dist_checkpointing
    from ptdp.megatron.checkpoint import from_megatron, to_megatron_checkpoint
    from_megatron(megatron["root"] / f"{arch}_dist", tmp_path / "ptdp", ["parallel.tensor=2"])
    args = mc.gpt_args() if arch == "gpt" else mc.bert_args()
    build = mc.build_gpt if arch == "gpt" else mc.build_bert
    for fmt in ("torch", "torch_dist"):
        info = to_megatron_checkpoint(tmp_path / "ptdp", tmp_path / fmt, transformer_impl="local",
                                      ckpt_format=fmt)
        assert info["padded_rows"] == 0 and info["args"].make_vocab_size_divisible_by == 128
        # Megatron-LM's check_checkpoint_args with the printed load command
        assert megatron_lm.assert_loads(info["directory"], info["load_flags"], mc.VOCAB) == 1
        fresh = build(args, seed=99)
        if fmt == "torch":
            mc.load_legacy_into(fresh, info["directory"])
        else:
            loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()},
                                             str(info["directory"]))   # as Megatron-LM does
            fresh.load_state_dict(loaded["model"], strict=True)
        if arch == "gpt":
            _close(mc.gpt_logits(fresh, TOKENS), megatron["gpt_logits"])
        else:
            for ours, theirs in zip(mc.bert_logits(fresh, TOKENS, TYPES), megatron["bert_logits"]):
                _close(ours, theirs)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_ptdp_megatron_ptdp_is_bit_identical(megatron, fmt, tmp_path):
    """ptdp -> Megatron (tensor 2, pipeline 2, TransformerEngine's names) -> ptdp."""
    from ptdp.megatron.checkpoint import from_megatron, read_megatron, to_megatron_checkpoint
    for arch in ("gpt", "bert"):
        from_megatron(megatron["root"] / f"{arch}_legacy", tmp_path / arch)
        info = to_megatron_checkpoint(tmp_path / arch, tmp_path / f"{arch}_meg", 2, 2,
                                      ckpt_format=fmt)
        assert megatron_lm.assert_loads(info["directory"], info["load_flags"], mc.VOCAB) == \
            (4 if fmt == "torch" else 1)
        if fmt == "torch":
            files = sorted(p.parent.name for p in (tmp_path / f"{arch}_meg").rglob("*.pt"))
            assert files == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                             "mp_rank_01_001"]
        back = read_megatron(tmp_path / f"{arch}_meg")
        assert back["format"] == fmt.replace("torch", "legacy", fmt == "torch")
        _, _, ours = read_full_state(tmp_path / arch)
        assert back["state"].keys() == ours.keys()
        assert all(torch.equal(back["state"][k], ours[k]) for k in ours)


def test_converted_checkpoint_trains_on(megatron, tmp_path):
    """One iteration of `ptdp train` (single process) continues from Megatron's iteration."""
    from ptdp.config import load_config
    from ptdp.megatron.checkpoint import from_megatron
    from ptdp.training import Trainer
    final, _, _ = from_megatron(megatron["root"] / "gpt_legacy", tmp_path / "ptdp")
    cfg = load_config(str(final / "config.yaml"),
                      [f"checkpoint.load={tmp_path}/ptdp", "train.iters=101",
                       "train.micro_batch_size=2", "train.global_batch_size=2",
                       "log.progress=false", "train.timeout_s=60"], world_size=1)
    trainer = Trainer(cfg)
    assert trainer.iteration == 100
    records = trainer.train()
    assert [r["iter"] for r in records] == [101]
    assert torch.isfinite(torch.tensor(records[0]["loss"]))


def test_a_converted_fp16_run_resumes_at_megatrons_learning_rate(megatron, tmp_path):
    """Megatron's scheduler does not advance over an update fp16 skipped: 3 of 100 iterations
    skipped leave it 3 batches behind the consumed samples. The converted checkpoint records
    them, and the resumed run's rate is megatron-core's scheduler's."""
    from argparse import Namespace

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from ptdp.config import load_config
    from ptdp.megatron.checkpoint import from_megatron
    from ptdp.optim.lr import learning_rate
    from ptdp.training import Trainer
    batch, skipped = 4, 3
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=20 * batch,
        lr_decay_steps=300 * batch, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=300 * batch, wd_incr_style="constant")
    for _ in range(100 - skipped):
        scheduler.step(increment=batch)
    args = Namespace(**vars(megatron["gpt_args"]), consumed_train_samples=100 * batch)
    mc.save_legacy(megatron["gpt"], args, tmp_path / "megatron", 100, scheduler.state_dict())
    final, _, found = from_megatron(tmp_path / "megatron", tmp_path / "ptdp")
    assert (found["consumed_samples"], found["skipped_samples"]) == (100 * batch, skipped * batch)
    cfg = load_config(str(final / "config.yaml"),
                      [f"checkpoint.load={tmp_path}/ptdp", "train.iters=300", "train.lr=3e-4",
                       "train.min_lr=3e-5", "train.lr_warmup_iters=20", "train.lr_decay_style=cosine",
                       "train.micro_batch_size=4", f"train.global_batch_size={batch}",
                       "log.progress=false"], world_size=1)
    progress = Trainer(cfg).state.progress
    assert (progress.iteration, progress.skipped_samples) == (100, skipped * batch)
    megatrons = optimizer.param_groups[0]["lr"]
    assert learning_rate(100, cfg.train, skipped_samples=progress.skipped_samples) == \
        pytest.approx(megatrons, rel=1e-12)
    assert learning_rate(100, cfg.train) != pytest.approx(megatrons, rel=1e-6)   # it matters


@pytest.mark.parametrize("arch, setting, words", [
    ("gpt", dict(num_experts=8, moe_expert_capacity_factor=1.0, moe_token_drop_policy="random"),
     "--moe-token-drop-policy=random: ptdp's drop policies are probs and position"),
    ("gpt", dict(normalization="LayerNorm1p"), "--normalization=LayerNorm1p"),
    ("gpt", dict(qk_layernorm=True), "--qk-layernorm=True"),
    ("gpt", dict(rotary_percent=0.5), "--rotary-percent=0.5"),
    ("gpt", dict(window_size=(8, 0)), "--window-size=\\(8, 0\\): the converter does not "
                                      "translate Megatron's sliding windows"),
    ("bert", dict(untie_embeddings_and_output_weights=True),
     "--untie-embeddings-and-output-weights with BERT"),
])
def test_what_ptdp_cannot_compute_is_refused_in_one_line(megatron, tmp_path, arch, setting,
                                                         words):
    from ptdp.megatron.checkpoint import read_megatron
    from ptdp.megatron.errors import MegatronConversionError
    iteration = {"gpt": 100, "bert": 5}[arch]
    name = f"iter_{iteration:07d}"
    src = megatron["root"] / f"{arch}_legacy" / name / "mp_rank_00" / "model_optim_rng.pt"
    saved = torch.load(src, weights_only=False)
    saved["args"] = (mc.gpt_args if arch == "gpt" else mc.bert_args)(**setting)
    sub = tmp_path / name / "mp_rank_00"
    sub.mkdir(parents=True)
    torch.save(saved, sub / "model_optim_rng.pt")
    with pytest.raises(MegatronConversionError, match=words) as err:
        read_megatron(tmp_path / name)
    assert "\n" not in str(err.value)


def test_command_line_both_ways(megatron, tmp_path, capsys):
    from ptdp.cli import main
    src = megatron["root"] / "bert_legacy"
    assert main(["convert", str(src), "--from", "megatron", "--out", str(tmp_path / "p"),
                 "parallel.pipeline=2"]) == 0
    assert "bert from Megatron's legacy checkpoint" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "p"), "--to", "megatron", str(tmp_path / "m"),
                 "parallel.tensor=2", "--ckpt-format", "torch"]) == 0
    out = capsys.readouterr().out   # BERT's MLP is GeLU with biases: Megatron's default fuses
    assert "--make-vocab-size-divisible-by 64" in out and "--no-bias-gelu-fusion" in out
    assert (tmp_path / "m" / "iter_0000005" / "mp_rank_01" / "model_optim_rng.pt").is_file()
    assert main(["convert", str(tmp_path / "p"), "--to", "megatron", str(tmp_path / "d")]) == 0
    assert "--ckpt-format torch_dist" in capsys.readouterr().out
    assert (tmp_path / "d" / "iter_0000005" / "metadata.json").is_file()
    assert main(["convert", str(tmp_path / "p"), "--to", "megatron", str(tmp_path / "x"),
                 "model.hidden_size=8"]) == 2
    assert "takes only parallel.tensor=T, parallel.pipeline=P and parallel.expert=E" in \
        capsys.readouterr().err
    assert main(["convert", str(tmp_path), "--from", "megatron", "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a Megatron checkpoint" in err
    for argv, line in [(["--to", "hf", str(tmp_path / "h"), "--ckpt-format", "torch"],
                        "--ckpt-format applies only to --to megatron"),
                       (["--to", "megatron", str(tmp_path / "e"), "--iteration", "3"],
                        "--iteration applies only to --from")]:
        assert main(["convert", str(tmp_path / "p"), *argv]) == 2
        assert capsys.readouterr().err == f"ptdp convert: {line}\n"


def test_converting_refuses_what_would_be_wrong_in_one_line(megatron, tmp_path, capsys):
    from ptdp.cli import main
    from ptdp.megatron.model_args import model_config, notes
    src, out = megatron["root"] / "gpt_legacy", str(tmp_path / "p")
    for extra, message in [
            (["model.tie_embeddings=true"], "model.tie_embeddings=true: the checkpoint's output "
                                            "layer is separate from the word table"),
            (["--tokenizer", str(tmp_path / "no.model")], f"tokenizer {tmp_path}/no.model not "
                                                         f"found"),
            (["--iteration", "-5"], "iteration -5: a checkpoint's iteration is 0 or more")]:
        assert main(["convert", str(src), "--from", "megatron", "--out", out, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not (tmp_path / "p").exists()
    # ffn 48 rows do not split over 5 tensor ranks (torch.chunk would drop a rank's share)
    assert main(["convert", str(src), "--from", "megatron", "--out", out]) == 0
    capsys.readouterr()
    assert main(["convert", out, "--to", "megatron", str(tmp_path / "m"), "parallel.tensor=5",
                 "--ckpt-format", "torch"]) == 2
    assert "model.ffn_hidden_size=48 does not split over parallel.tensor=5" in \
        capsys.readouterr().err
    # a run with Megatron's fused bias-GeLU computed the tanh GeLU (gelu_tanh for GPT, a note
    # for ptdp's BERT, whose block is GPT-2's); one without it the exact
    fused, plain = mc.bert_args(bias_gelu_fusion=True), mc.bert_args(bias_gelu_fusion=False)
    assert model_config(fused, "gpt").activation == "gelu_tanh"
    assert model_config(fused, "bert").activation == "gelu"
    assert any("fused bias-GeLU" in line for line in notes(fused, "bert"))
    assert model_config(plain, "gpt").activation == "gelu" and not notes(plain, "bert")
    assert any("--openai-gelu" in line for line in notes(mc.bert_args(openai_gelu=True), "gpt"))


def test_legacy_model_names_and_old_versions_are_refused_naming_the_way_out(tmp_path):
    from ptdp.megatron.checkpoint import read_megatron
    from ptdp.megatron.errors import MegatronConversionError
    for name, version, words in [("a", 3.0, "tools/checkpoint/convert.py"),
                                 ("b", 2.0, "checkpoint_version 2.0")]:
        sub = tmp_path / name / "release" / "mp_rank_00"
        sub.mkdir(parents=True)
        model = {"language_model.embedding.word_embeddings.weight": torch.zeros(mc.VOCAB, 32)}
        torch.save({"args": mc.gpt_args(), "checkpoint_version": version, "model": model},
                   sub / "model_optim_rng.pt")
        (tmp_path / name / "latest_checkpointed_iteration.txt").write_text("release")
        with pytest.raises(MegatronConversionError, match=words):
            read_megatron(tmp_path / name)


def test_megatron_classes_in_the_pickles_need_no_megatron(megatron, tmp_path, monkeypatch):
    """Megatron-LM's args hold its enums; reading them imports nothing of Megatron."""
    import sys
    from megatron.core.enums import ModelType
    from ptdp.megatron.checkpoint import read_megatron
    from ptdp.megatron.files import Opaque
    src = megatron["root"] / "gpt_legacy" / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt"
    saved = torch.load(src, weights_only=False)
    saved["args"].model_type = ModelType.encoder_or_decoder
    sub = tmp_path / "iter_0000100" / "mp_rank_00"
    sub.mkdir(parents=True)
    torch.save(saved, sub / "model_optim_rng.pt")
    monkeypatch.setitem(sys.modules, "megatron", None)   # any import of megatron now fails
    found = read_megatron(tmp_path / "iter_0000100")
    assert isinstance(found["args"].model_type, Opaque) and found["model"].num_layers == 2


def test_what_megatron_cannot_compute_is_not_written(megatron, tmp_path, capsys):
    from ptdp.cli import main
    assert main(["convert", str(megatron["root"] / "gpt_legacy"), "--from", "megatron", "--out",
                 str(tmp_path / "p"), "model.rope_scaling_factor=8",
                 "model.rope_low_freq_factor=2"]) == 0
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "p"), "--to", "megatron", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "model.rope_low_freq_factor=2.0: Megatron's rope scaling fixes it at 1.0" in err
    assert not (tmp_path / "m").exists()


def test_tables_cut_to_seq_length_and_a_smaller_vocabulary(megatron, tmp_path):
    """A BERT trained at --seq-length 8 with a 16-row position table converts with
    model.seq_length=8 (the rows Megatron trained); model.vocab_size=100 keeps the first 100
    rows of its padded vocabulary. The logits that remain are megatron-core's."""
    from ptdp.megatron.checkpoint import from_megatron
    name = "iter_0000005"
    src = megatron["root"] / "bert_legacy" / name / "mp_rank_00" / "model_optim_rng.pt"
    saved = torch.load(src, weights_only=False)
    saved["args"] = mc.bert_args(seq_length=8)
    (tmp_path / name / "mp_rank_00").mkdir(parents=True)
    torch.save(saved, tmp_path / name / "mp_rank_00" / "model_optim_rng.pt")
    _, cfg, found = from_megatron(tmp_path / name, tmp_path / "p", ["model.vocab_size=100"])
    assert (cfg.model.seq_length, cfg.model.vocab_size) == (8, 100)
    assert "from --seq-length=8 on" in found["notes"][0]
    tokens, types_ = TOKENS[:, :8] % 100, TYPES[:, :8]
    lm, binary = mc.bert_logits(megatron["bert"], tokens, types_)
    model = LocalModel.from_checkpoint(tmp_path / "p")
    keep = torch.ones_like(tokens)
    _close(model.logits(tokens, types_, keep), lm[..., :100])
    _close(model.sentence_order_logits(tokens, types_, keep), binary)


def test_a_truncated_distcp_file_is_one_line(megatron, tmp_path, capsys):
    """torch.distributed.checkpoint's CheckpointException carries every rank's traceback; the
    conversion says the first error in one line."""
    import shutil
    from ptdp.cli import main
    src = tmp_path / "gpt_dist"
    shutil.copytree(megatron["root"] / "gpt_dist", src)
    for shard in src.rglob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:-4096])
    assert main(["convert", str(src), "--from", "megatron", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read the weights (" in err, err
    assert not (tmp_path / "p").exists()


def test_a_checkpoint_without_megatron_lms_args_takes_the_shape_given(megatron, tmp_path):
    """A megatron-core torch_dist checkpoint whose common.pt has no 'args' (Megatron-Bridge,
    NeMo 2): one line names what the weights cannot show; the overrides, or a run_config.yaml
    beside it (megatron-core's TransformerConfig names), give it, and the logits are
    megatron-core's."""
    import shutil

    from ptdp.megatron.checkpoint import from_megatron
    from ptdp.megatron.errors import MegatronConversionError
    src = tmp_path / "bridge"
    shutil.copytree(megatron["root"] / "gpt_dist", src)
    common = src / "iter_0000100" / "common.pt"
    torch.save({k: v for k, v in torch.load(common, weights_only=False).items() if k != "args"},
               common)
    with pytest.raises(MegatronConversionError) as err:
        from_megatron(src, tmp_path / "refused", ["model.num_heads=4"])
    assert str(err.value) == (
        "the checkpoint has no 'args' (Megatron-LM's) and nothing beside it gives "
        "model.layernorm_eps, model.rope_theta, model.seq_length: give them as overrides "
        "(e.g. model.layernorm_eps=...)")
    given = ["model.num_heads=4", "model.layernorm_eps=1e-5", "model.rope_theta=10000",
             "model.seq_length=16"]
    _, cfg, _ = from_megatron(src, tmp_path / "given", given)
    assert (cfg.model.num_kv_heads, cfg.model.activation, cfg.model.tie_embeddings) == \
        (2, "swiglu", False)
    _close(LocalModel.from_checkpoint(tmp_path / "given").logits(TOKENS), megatron["gpt_logits"])
    (src / "iter_0000100" / "run_config.yaml").write_text(
        "model:\n  num_layers: 2\n  hidden_size: 32\n  num_attention_heads: 4\n"
        "  num_query_groups: 2\n  layernorm_epsilon: 1.0e-5\n  rotary_base: 10000\n"
        "  seq_length: 16\n  normalization: RMSNorm\n  gated_linear_unit: true\n"
        "  activation_func: torch.nn.functional.silu\n  add_bias_linear: false\n"
        "  share_embeddings_and_output_weights: false\n")
    from_megatron(src, tmp_path / "beside")
    _close(LocalModel.from_checkpoint(tmp_path / "beside").logits(TOKENS),
           megatron["gpt_logits"])


def test_zero_centred_norm_and_tanh_gelu_convert_exactly(megatron, tmp_path):
    """A GPT-2-style megatron-core model with --apply-layernorm-1p (gain 1 + w) and
    Megatron-LM's default fused bias-GeLU (tanh): ptdp's model.norm_zero_centered and
    model.activation: gelu_tanh give its logits, both ways."""
    from ptdp.megatron.checkpoint import from_megatron, to_megatron_checkpoint
    args = mc.gpt_args(position_embedding_type="learned_absolute", normalization="LayerNorm",
                       swiglu=False, add_bias_linear=True, group_query_attention=False,
                       num_query_groups=None, untie_embeddings_and_output_weights=False,
                       ffn_hidden_size=64, apply_layernorm_1p=True, bias_gelu_fusion=True)
    model = mc.build_gpt(args, seed=5)
    reference = mc.gpt_logits(model, TOKENS)
    mc.save_legacy(model, args, tmp_path / "meg", 3)
    _, cfg, _ = from_megatron(tmp_path / "meg", tmp_path / "ptdp")
    assert (cfg.model.activation, cfg.model.norm_zero_centered) == ("gelu_tanh", True)
    _close(LocalModel.from_checkpoint(tmp_path / "ptdp").logits(TOKENS), reference)
    info = to_megatron_checkpoint(tmp_path / "ptdp", tmp_path / "back", transformer_impl="local",
                                  ckpt_format="torch")
    assert "--apply-layernorm-1p" in info["load_flags"]
    assert "--no-bias-gelu-fusion" not in info["load_flags"]
    fresh = mc.build_gpt(args, seed=99)
    mc.load_legacy_into(fresh, info["directory"])
    _close(mc.gpt_logits(fresh, TOKENS), reference)


@pytest.mark.parametrize("activation, refused", [("swiglu", None), ("geglu", "geglu")])
def test_only_swiglu_is_written_as_megatrons_gated_mlp(activation, refused):
    """megatron-core's gated MLP is SwiGLU: a GeGLU model would silently change there."""
    from ptdp.config import ModelConfig
    from ptdp.megatron.model_args import refuse_for_megatron
    from ptdp.megatron.errors import MegatronConversionError
    cfg = ModelConfig(preset="llama", num_layers=2, hidden_size=32, num_heads=4, seq_length=8,
                      vocab_size=64, activation=activation)
    if refused is None:
        refuse_for_megatron(cfg)
        return
    with pytest.raises(MegatronConversionError, match="model.activation=geglu"):
        refuse_for_megatron(cfg)


def test_sliding_windows_are_refused_both_ways_rather_than_dropped():
    """Megatron's --window-size is not translated: a windowed model would silently attend
    globally on the other side."""
    from ptdp.config import ModelConfig
    from ptdp.megatron.model_args import refuse_for_megatron
    from ptdp.megatron.errors import MegatronConversionError
    from ptdp.megatron.translate import translate
    cfg = ModelConfig(preset="llama", num_layers=2, hidden_size=32, num_heads=4, seq_length=8,
                      vocab_size=64, sliding_window=4)
    with pytest.raises(MegatronConversionError, match="model.sliding_window: the converter"):
        refuse_for_megatron(cfg)
    refused = [line for line in translate(["--window-size", "4096,0"]).lines
               if line.argument.startswith("--window-size")]
    assert [(line.kind, line.blocks) for line in refused] == [("refused", True)]


def test_yarn_scaling_is_not_written_as_megatrons_llama3_scaling():
    """Megatron-LM's GPT knows Llama 3's rotary scaling only: a YaRN model is refused rather
    than written with --use-rope-scaling."""
    from ptdp.config import ModelConfig
    from ptdp.megatron.model_args import refuse_for_megatron
    from ptdp.megatron.errors import MegatronConversionError
    cfg = ModelConfig(preset="llama", num_layers=2, hidden_size=32, num_heads=4, seq_length=8,
                      vocab_size=64, rope_scaling_factor=4.0, rope_scaling_type="yarn")
    with pytest.raises(MegatronConversionError, match="model.rope_scaling_type=yarn"):
        refuse_for_megatron(cfg)
