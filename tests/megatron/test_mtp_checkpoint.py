"""Multi-token prediction's Megatron checkpoints both ways, against megatron-core's own GPT with
MTP depths (`mtp_block_spec` from `get_gpt_mtp_block_spec`, as Megatron-LM's GPT builder makes
it) built, run and saved on CPU (tests/megatron/mcore_models.py): two depths on the Llama-style
GPT with λ = 0.3, one depth with tied embeddings and LayerNorm, one MoE depth (selection biases,
shared expert), one latent-attention depth. Converted from legacy and torch_dist files, ptdp's
main loss, each depth's loss (megatron-core tracks L_k in MTPLossLoggingHelper; ptdp returns
λ/D · L_k as `mtp_k`) and every gradient of the objective (megatron-core adds the depths'
terms in backward through MTPLossAutoScaler) equal megatron-core's; ptdp -> Megatron loads
strictly into megatron-core with its losses; a hand-made pipeline split and ptdp's own splits
read back bit for bit; what ptdp would compute otherwise is refused in one line.
"""

from __future__ import annotations

from argparse import Namespace

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from ptdp.inference.local_model import LocalModel  # noqa: E402
from tests.megatron import mcore_models as mc, megatron_lm  # noqa: E402

_GEN = torch.Generator().manual_seed(11)
TOKENS = torch.randint(0, mc.VOCAB, (2, mc.SEQ + 1), generator=_GEN)
LOSS_MASK = (torch.rand(2, mc.SEQ, generator=_GEN) > 0.25).float()   # some positions off

CASES = {
    "dense2": (mc.gpt_args(mtp_num_layers=2, mtp_loss_scaling_factor=0.3), 5),
    "tied1": (mc.gpt_args(mtp_num_layers=1, untie_embeddings_and_output_weights=False,
                          normalization="LayerNorm"), 6),
    "moe1": (mc.moe_args(mtp_num_layers=1, moe_aux_loss_coeff=0.0), 7),
    "mla1": (mc.mla_args(mtp_num_layers=1), 8),
}


def megatron_run(model) -> dict:
    """megatron-core's training forward and backward of one micro-batch: the main loss (the
    masked mean of its per-token losses, as pretrain_gpt.py's loss_func), the depths' losses
    L_k its MTPLossLoggingHelper tracks, and the gradients of the objective, into which
    MTPLossAutoScaler adds λ/D · L_k (scale 1: one micro-batch)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    s = mc.SEQ
    mask = torch.triu(torch.ones(1, 1, s, s), diagonal=1).bool()
    MTPLossLoggingHelper.tracker.clear()
    model.train().zero_grad()
    per_token = model(TOKENS[:, :-1], torch.arange(s).expand(2, s), mask,
                      labels=TOKENS[:, 1:], loss_mask=LOSS_MASK)
    loss = (per_token * LOSS_MASK).sum() / LOSS_MASK.sum()
    loss.backward()
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
             for name, p in model.named_parameters()}
    model.zero_grad()
    model.eval()
    return {"loss": loss.detach(), "depths": MTPLossLoggingHelper.tracker["values"].clone(),
            "grads": grads}


def megatron_logits(model) -> torch.Tensor:
    """megatron-core's main-head logits [b, s, vocab]: its GPT with depths computes them only
    with labels (gpt_model.py `_postprocess` clones them), so they are taken from the last of
    its output layer's calls (the depths' come first)."""
    seen = []
    hook = model.output_layer.register_forward_hook(
        lambda m, i, out: seen.append(out[0].clone()))   # (the loss then edits them in place)
    s = mc.SEQ
    with torch.no_grad():
        model(TOKENS[:, :-1], torch.arange(s).expand(2, s),
              torch.triu(torch.ones(1, 1, s, s), diagonal=1).bool(), labels=TOKENS[:, 1:])
    hook.remove()
    return seen[-1].transpose(0, 1).float()


def ptdp_run(model: LocalModel) -> dict:
    """The same micro-batch through ptdp's chunk (models/gpt.py), the depths' targets from
    ptdp/data/batching.py `future_targets`: the main loss, {mtp_k: λ/D · L_k}, and the gradients
    of the objective (the loss plus every side output, as the executor adds them)."""
    from ptdp.data.batching import future_targets
    from ptdp.models import named_global_parameters
    chunk = model.chunk.train()
    chunk.zero_grad()
    batch = {"tokens": TOKENS[:, :-1], "labels": TOKENS[:, 1:], "loss_mask": LOSS_MASK}
    batch.update(future_targets(batch, model.cfg.mtp_layers))
    out = chunk(None, batch)
    loss, aux = out.output[0], out.aux_losses
    (loss + sum(aux.values())).backward()
    grads = {name: p.grad.clone() for name, p in named_global_parameters(chunk)}
    chunk.zero_grad()
    chunk.eval()
    return {"loss": loss.detach(), "aux": {k: v.detach() for k, v in aux.items()},
            "grads": grads}


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    out = {"root": root}
    with pytest.MonkeyPatch.context() as mp, mc.cpu_megatron(mp):
        for name, (args, seed) in CASES.items():
            model = mc.build_gpt(args, seed=seed)
            mc.save_legacy(model, args, root / f"{name}_legacy", 9)
            mc.save_torch_dist(model, args, root / f"{name}_dist", 9)
            _pipeline_split(model, args, root / f"{name}_p2")
            partitions = {n: (p.partition_dim if getattr(p, "tensor_model_parallel", False)
                              else None) for n, p in model.named_parameters()}
            out[name] = {"args": args, "run": megatron_run(model), "partitions": partitions,
                         "logits": megatron_logits(model)}
        out["mp"] = mp
        yield out


def _pipeline_split(model, args, root) -> None:
    """Megatron-LM's legacy files of the same model at pipeline size 2, by megatron-core's
    rules, independently of ptdp/megatron: stage 0 the embedding and the first half of the
    layers; stage 1 the other half renumbered from 0, the final norm, the depths
    (`mtp.layers.{j}`), its copy of the word table (the depths embed tokens; gpt_model.py
    `setup_embeddings_and_output_layer`) and its output layer — with tied embeddings one
    megatron-core allocates but never uses (the logits take the embedding's), here noise."""
    full, half = model.state_dict_for_save_checkpoint(), args.num_layers // 2
    stages: list[dict] = [{}, {}]
    for name, value in full.items():
        parts = name.split(".")
        if name.startswith("decoder.layers."):
            layer = int(parts[2])
            parts[2] = str(layer % half)
            stages[layer // half][".".join(parts)] = value
        elif name.startswith("embedding."):
            stages[0][name] = value
            stages[1][name] = value.clone()
        else:
            stages[1][name] = value
    if not args.untie_embeddings_and_output_weights:
        unused = torch.randn_like(full["embedding.word_embeddings.weight"])
        stages[1]["output_layer.weight"] = unused
    p2 = Namespace(**dict(vars(args), pipeline_model_parallel_size=2))
    for p, state in enumerate(stages):
        sub = root / "iter_0000009" / f"mp_rank_00_{p:03d}"
        sub.mkdir(parents=True)
        torch.save({"args": p2, "checkpoint_version": 3.0, "iteration": 9, "model": state},
                   sub / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("9")


def _close(ours, theirs, what="", tol=1e-5):
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _compare_runs(cfg, ours: dict, theirs: dict) -> None:
    """ptdp's run against megatron-core's: main loss, every depth's loss (λ/D · L_k), every
    gradient (megatron-core's renamed and reordered as a checkpoint's weights are)."""
    from ptdp.megatron.names import to_ptdp
    _close(ours["loss"], theirs["loss"], "main loss")
    depths = cfg.mtp_layers
    assert sorted(k for k in ours["aux"] if k.startswith("mtp_")) == [
        f"mtp_{k}" for k in range(1, depths + 1)]
    for k in range(1, depths + 1):
        _close(ours["aux"][f"mtp_{k}"], cfg.mtp_loss_scale / depths * theirs["depths"][k - 1],
               f"mtp_{k}")
    assert len(set(float(v) for v in theirs["depths"])) == depths   # the depths differ
    grads = to_ptdp(cfg, theirs["grads"])
    assert grads.keys() == ours["grads"].keys()
    for name, grad in grads.items():
        _close(ours["grads"][name], grad, f"gradient of {name}")
    assert any(name.startswith("mtp.") and grad.abs().sum() > 0 for name, grad in grads.items())


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fmt", ["legacy", "dist", "p2"])
def test_megatron_mtp_converts_with_megatron_cores_losses_and_gradients(mtp, case, fmt, tmp_path):
    from ptdp.megatron.checkpoint import from_megatron
    _, cfg, found = from_megatron(mtp["root"] / f"{case}_{fmt}", tmp_path / "ptdp")
    args = mtp[case]["args"]
    assert (cfg.model.mtp_layers, cfg.model.mtp_loss_scale) == (
        args.mtp_num_layers, getattr(args, "mtp_loss_scaling_factor", 0.1))
    assert sum(name.startswith("mtp.") for name in found["megatron"]) > 0
    model = LocalModel.from_checkpoint(tmp_path / "ptdp")
    _close(model.logits(TOKENS[:, :-1]), mtp[case]["logits"], "logits")
    _compare_runs(cfg.model, ptdp_run(model), mtp[case]["run"])
    if case == "moe1":   # the depth's router's selection bias, under its global layer index
        biases = found["megatron"]["mtp.layers.0.transformer_layer.mlp.router.expert_bias"]
        router = model.chunk.mtp[0].stack.layers[0].mlp.router
        assert torch.equal(router.expert_bias, biases.float()) and biases.abs().sum() > 0


def test_the_formats_and_splits_read_to_the_same_weights(mtp):
    from ptdp.megatron.checkpoint import read_megatron
    for case in CASES:
        states = [read_megatron(mtp["root"] / f"{case}_{fmt}")["state"]
                  for fmt in ("legacy", "dist", "p2")]
        for state in states[1:]:
            assert state.keys() == states[0].keys(), case
            assert all(torch.equal(state[k], states[0][k]) for k in state), case


def test_the_depths_tensor_splits_are_megatron_cores(mtp):
    """Every parameter's tensor-parallel dimension (names.py `partition_dim`) is the one
    megatron-core gives it: `eh_proj` column-parallel (its rows split), the depth's layer's as a
    decoder layer's, its norms replicated."""
    from ptdp.megatron.names import partition_dim
    # (latent attention's down-projections: column-parallel in megatron-core's local spec,
    # replicated in TransformerEngine's; ptdp/megatron/checkpoint.py refuses such legacy splits)
    down = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")
    for case in CASES:
        partitions = mtp[case]["partitions"]
        assert partitions["mtp.layers.0.eh_proj.weight"] == 0
        for name, dim in partitions.items():
            assert partition_dim(name) == dim or name.endswith(down), (case, name)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_ptdp_mtp_loads_in_megatron_core_with_its_losses(mtp, case, fmt, tmp_path):
    """ptdp -> Megatron: megatron-core's MTP GPT loads the checkpoint strictly and computes the
    main loss, the depths' losses and the gradients of the model it came from; Megatron-LM's
    argument check passes; the load command carries the MTP flags."""
    from megatron.core import dist_checkpointing
    from ptdp.megatron.checkpoint import from_megatron, to_megatron_checkpoint
    args, seed = CASES[case]
    from_megatron(mtp["root"] / f"{case}_dist", tmp_path / "ptdp")
    info = to_megatron_checkpoint(tmp_path / "ptdp", tmp_path / fmt, transformer_impl="local",
                                  ckpt_format=fmt)
    assert megatron_lm.assert_loads(info["directory"], info["load_flags"], mc.VOCAB) == 1
    flags = " ".join(info["load_flags"])
    scale = getattr(args, "mtp_loss_scaling_factor", 0.1)
    assert f"--mtp-num-layers {args.mtp_num_layers} --mtp-loss-scaling-factor {scale}" in flags
    assert (info["args"].mtp_num_layers, info["args"].mtp_loss_scaling_factor) == (
        args.mtp_num_layers, scale)
    fresh = mc.build_gpt(args, seed=seed + 90)
    if fmt == "torch":
        mc.load_legacy_into(fresh, info["directory"])
    else:
        loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()},
                                         str(info["directory"]))
        fresh.load_state_dict(loaded["model"], strict=True)
    run, reference = megatron_run(fresh), mtp[case]["run"]
    _close(run["loss"], reference["loss"], "main loss")
    _close(run["depths"], reference["depths"], "depths")
    for name, grad in reference["grads"].items():
        _close(run["grads"][name], grad, name)


@pytest.mark.parametrize("case", ["dense2", "tied1"])
def test_ptdp_megatron_ptdp_round_trip_is_exact(mtp, case, tmp_path):
    """ptdp -> Megatron legacy files split (tensor 2, pipeline 2) -> ptdp: the same weights bit
    for bit; the last stage holds the depths, eh_proj's rows split, and megatron-core's copy of
    the word table."""
    from ptdp.inference.local_model import read_full_state
    from ptdp.megatron.checkpoint import from_megatron, to_megatron_checkpoint
    from_megatron(mtp["root"] / f"{case}_legacy", tmp_path / "ptdp")
    info = to_megatron_checkpoint(tmp_path / "ptdp", tmp_path / "meg", 2, 2, ckpt_format="torch")
    assert megatron_lm.assert_loads(info["directory"], info["load_flags"], mc.VOCAB) == 4
    last = torch.load(info["directory"] / "mp_rank_01_001" / "model_optim_rng.pt",
                      weights_only=False)["model"]
    first = torch.load(info["directory"] / "mp_rank_01_000" / "model_optim_rng.pt",
                       weights_only=False)["model"]
    assert last["mtp.layers.0.eh_proj.weight"].shape == (16, 64)   # h / t rows of [h, 2h]
    assert torch.equal(last["embedding.word_embeddings.weight"],
                       first["embedding.word_embeddings.weight"])
    assert not any(name.startswith("mtp.") for name in first)
    from_megatron(tmp_path / "meg", tmp_path / "back")
    _, _, before = read_full_state(tmp_path / "ptdp")
    _, _, after = read_full_state(tmp_path / "back")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_what_ptdp_would_compute_otherwise_is_refused_in_one_line(mtp, tmp_path):
    from ptdp.megatron.checkpoint import read_megatron
    from ptdp.megatron.model_args import model_config, notes
    from ptdp.megatron.errors import MegatronConversionError
    base = vars(mtp["dense2"]["args"])
    for extra, message in [
            (dict(mtp_use_repeated_layer=True), "--mtp-use-repeated-layer: Megatron runs one MTP "
                                                "layer at every depth"),
            (dict(position_embedding_type="learned_absolute"),
             "--mtp-num-layers=2 with --position-embedding-type=learned_absolute: ptdp's "
             "prediction depths need rotary positions")]:
        with pytest.raises(MegatronConversionError) as err:
            model_config(Namespace(**dict(base, **extra)), "gpt")
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert notes(Namespace(**dict(base, mtp_detach_heads=True)), "gpt") == [
        "the depths' loss did not reach the main model (--mtp-detach-heads); ptdp's training "
        "lets it"]
    # a checkpoint whose args have no depths but whose files do
    args = Namespace(**dict(base, mtp_num_layers=None))
    found = read_megatron(mtp["root"] / "dense2_legacy")
    from ptdp.megatron.names import to_ptdp
    with pytest.raises(MegatronConversionError, match=r"holds 'mtp\.layers\.0\..*' \(and \d+ "
                                                      r"more\), which ptdp's model has no place"):
        to_ptdp(model_config(args, "gpt"), found["megatron"])


def test_an_args_less_mtp_checkpoint_counts_its_depths(mtp, tmp_path):
    """A torch_dist checkpoint without Megatron-LM's args (Megatron-Bridge, NeMo 2): the depths
    counted from the weights, λ from the TransformerConfig beside it; megatron-core's losses."""
    import shutil

    import yaml

    from ptdp.megatron.checkpoint import from_megatron
    src = tmp_path / "bridge"
    shutil.copytree(mtp["root"] / "dense2_dist", src)
    common = src / "iter_0000009" / "common.pt"
    torch.save({k: v for k, v in torch.load(common, weights_only=False).items() if k != "args"},
               common)
    args = mtp["dense2"]["args"]
    config = dict(mc.transformer_config(args).__dict__, seq_length=args.seq_length,
                  rotary_base=args.rotary_base)
    fields = {k: v for k, v in config.items()
              if isinstance(v, (int, float, str, bool)) and k != "mtp_num_layers"}
    (src / "iter_0000009" / "run_config.yaml").write_text(yaml.safe_dump({"model": fields}))
    _, cfg, _ = from_megatron(src, tmp_path / "ptdp")
    assert (cfg.model.mtp_layers, cfg.model.mtp_loss_scale) == (2, 0.3)
    _compare_runs(cfg.model, ptdp_run(LocalModel.from_checkpoint(tmp_path / "ptdp")),
                  mtp["dense2"]["run"])
