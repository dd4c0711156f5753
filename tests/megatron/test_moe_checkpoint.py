"""Mixture-of-experts Megatron checkpoints both ways, against megatron-core's own MoE GPT
built and saved on CPU (tests/megatron/mcore_models.py): SequentialMLP experts with sigmoid
scores, selection biases, scaled gates and a gated shared expert, saved as legacy files split
over two expert-parallel ranks and as torch_dist; GroupedMLP's stacked layout (softmax scores)
in legacy files. Each converts to ptdp with megatron-core's logits, and back into files
megatron-core loads strictly with the same logits; Megatron-LM's argument checks pass.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from ptdp.inference.local_model import LocalModel  # noqa: E402
from tests.megatron import mcore_models as mc, megatron_lm  # noqa: E402

TOKENS = torch.randint(0, mc.VOCAB, (2, mc.SEQ), generator=torch.Generator().manual_seed(1))
GROUPED = dict(moe_grouped_gemm=True, moe_router_score_function="softmax",
               moe_router_enable_expert_bias=False, moe_router_topk_scaling_factor=None,
               moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
               moe_router_num_groups=None, moe_router_group_topk=None)


def _expert_split(model, args, root, expert: int):
    """Megatron-LM's legacy files of an expert-parallel job (tensor and pipeline size 1) from
    megatron-core's (1, 1) state dict by its rules, independently of ptdp/megatron: rank r
    keeps experts [r E/e, (r+1) E/e) as `local_experts.0..`, the rest on every rank, in
    mp_rank_00_{r:03d} (checkpointing.py get_checkpoint_name)."""
    full, per = model.state_dict_for_save_checkpoint(), args.num_experts // expert
    for r in range(expert):
        mine = {}
        for name, value in full.items():
            parts = name.split(".")
            if "local_experts" in parts:
                at = parts.index("local_experts") + 1
                if int(parts[at]) // per != r:
                    continue
                parts[at] = str(int(parts[at]) % per)
            mine[".".join(parts)] = value
        sub = root / "iter_0000009" / f"mp_rank_00_{r:03d}"
        sub.mkdir(parents=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 9, "model": mine},
                   sub / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("9")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    with pytest.MonkeyPatch.context() as mp, mc.cpu_megatron(mp):
        args = mc.moe_args(expert_model_parallel_size=2)
        grouped_args = mc.moe_args(**GROUPED)
        model, grouped = mc.build_gpt(args, seed=3), mc.build_gpt(grouped_args, seed=4)
        _expert_split(model, args, root / "legacy_ep2", 2)
        mc.save_torch_dist(model, args, root / "dist", 9)
        mc.save_legacy(grouped, grouped_args, root / "grouped", 9)
        mc.save_torch_dist(grouped, grouped_args, root / "grouped_dist", 9)
        yield {"root": root, "args": args, "grouped_args": grouped_args,
               "logits": mc.gpt_logits(model, TOKENS),
               "grouped_logits": mc.gpt_logits(grouped, TOKENS), "mp": mp}


def _close(ours, theirs):
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    return (ours - theirs).abs().max().item()


@pytest.mark.parametrize("source, reference", [("legacy_ep2", "logits"), ("dist", "logits"),
                                               ("grouped", "grouped_logits"),
                                               ("grouped_dist", "grouped_logits")])
def test_megatron_moe_converts_with_megatron_cores_logits(moe, source, reference, tmp_path):
    from ptdp.megatron.checkpoint import from_megatron
    _, cfg, found = from_megatron(moe["root"] / source, tmp_path / "ptdp",
                                  ["parallel.tensor=2"])
    m = cfg.model
    assert (m.num_experts, m.moe_top_k, m.moe_ffn_hidden_size) == (4, 2, 24)
    if not source.startswith("grouped"):
        assert (m.moe_score_function, m.moe_routed_scaling_factor, m.moe_shared_ffn_hidden_size,
                m.moe_shared_expert_gate, m.moe_expert_bias_rate, m.moe_router_groups,
                m.moe_router_group_top_k) == ("sigmoid", 2.5, 16, True, 1e-3, 2, 1)
    model = LocalModel.from_checkpoint(tmp_path / "ptdp")
    _close(model.logits(TOKENS), moe[reference])


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_ptdp_moe_loads_in_megatron_core(moe, fmt, tmp_path):
    """ptdp -> Megatron: megatron-core's MoE GPT loads it strictly and computes the logits of
    the model it came from; Megatron-LM's argument check passes; an expert-parallel split of
    the same checkpoint reads back bit-identically."""
    from megatron.core import dist_checkpointing
    from ptdp.megatron.checkpoint import from_megatron, read_megatron, to_megatron_checkpoint
    from_megatron(moe["root"] / "dist", tmp_path / "ptdp")
    info = to_megatron_checkpoint(tmp_path / "ptdp", tmp_path / fmt, transformer_impl="local",
                                  ckpt_format=fmt)
    assert megatron_lm.assert_loads(info["directory"], info["load_flags"], mc.VOCAB) == 1
    flags = " ".join(info["load_flags"])
    assert "--num-experts 4" in flags
    assert "--moe-router-num-groups 2 --moe-router-group-topk 1" in flags
    fresh = mc.build_gpt(mc.moe_args(), seed=99)
    if fmt == "torch":
        mc.load_legacy_into(fresh, info["directory"])
    else:
        loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()},
                                         str(info["directory"]))
        fresh.load_state_dict(loaded["model"], strict=True)
    _close(mc.gpt_logits(fresh, TOKENS), moe["logits"])
    if fmt == "torch":
        split = to_megatron_checkpoint(tmp_path / "ptdp", tmp_path / "ep", 2, 1,
                                       ckpt_format="torch", expert=2)
        names = sorted(p.parent.name for p in split["directory"].rglob("*.pt"))
        assert names == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
        assert megatron_lm.assert_loads(split["directory"], split["load_flags"], mc.VOCAB) == 4
        back, original = read_megatron(tmp_path / "ep"), read_megatron(tmp_path / fmt)
        assert back["state"].keys() == original["state"].keys()
        assert all(torch.equal(back["state"][k], original["state"][k]) for k in back["state"])


def test_ptdp_moe_writes_the_grouped_layout(moe, tmp_path):
    """Legacy files in GroupedMLP's two tensors, and torch_dist (layout-free: GroupedMLP asks
    for SequentialMLP's keys) load strictly into megatron-core's GroupedMLP model."""
    from megatron.core import dist_checkpointing
    from ptdp.megatron.checkpoint import from_megatron, to_megatron_checkpoint
    from_megatron(moe["root"] / "grouped", tmp_path / "ptdp")
    info = to_megatron_checkpoint(tmp_path / "ptdp", tmp_path / "out", transformer_impl="local",
                                  ckpt_format="torch", grouped=True)
    assert info["args"].moe_grouped_gemm and "--moe-grouped-gemm" in info["load_flags"]
    fresh = mc.build_gpt(moe["grouped_args"], seed=99)
    mc.load_legacy_into(fresh, info["directory"])
    _close(mc.gpt_logits(fresh, TOKENS), moe["grouped_logits"])
    info = to_megatron_checkpoint(tmp_path / "ptdp", tmp_path / "dist", transformer_impl="local")
    fresh = mc.build_gpt(moe["grouped_args"], seed=98)
    loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()}, str(info["directory"]))
    fresh.load_state_dict(loaded["model"], strict=True)
    _close(mc.gpt_logits(fresh, TOKENS), moe["grouped_logits"])


def test_the_selection_bias_goes_with_sigmoid_scores_only():
    """Megatron-LM 0.16 adds the expert bias under sigmoid scores only: a ptdp softmax model
    with the bias is refused on the way out, and a Megatron softmax checkpoint's enabled bias
    (which Megatron never applies) is read as no bias."""
    from argparse import Namespace

    from ptdp.config import load_config
    from ptdp.megatron.moe_args import moe_config, refuse_moe_for_megatron
    from ptdp.megatron.errors import MegatronConversionError
    base = ["model.num_experts=4", "model.moe_top_k=2", "model.bias=false"]
    softmax = load_config(None, base + ["model.moe_expert_bias_rate=0.001"], world_size=1).model
    with pytest.raises(MegatronConversionError, match="moe_expert_bias_rate.*softmax"):
        refuse_moe_for_megatron(softmax)
    sigmoid = load_config(None, base + ["model.moe_expert_bias_rate=0.001",
                                        "model.moe_score_function=sigmoid"], world_size=1).model
    refuse_moe_for_megatron(sigmoid)
    args = Namespace(num_experts=4, num_layers=2, moe_router_topk=2, add_bias_linear=False,
                     moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3)
    def get(a, name, default):
        return getattr(a, name, default)
    assert moe_config(args, get)["moe_expert_bias_rate"] == 0.0
    args.moe_router_score_function = "sigmoid"
    assert moe_config(args, get)["moe_expert_bias_rate"] == 1e-3


def test_expert_names_are_read_one_way_in_every_layout():
    """ptdp/megatron/experts.py's one reading of megatron-core's expert names: full and
    layer-relative (torch_dist's extra states) names, written back by `local_name`; the
    shared expert and the router are not experts; the args-less shape counts the experts."""
    from ptdp.megatron.experts import expert_name, local_name, stacked, stacked_name
    from ptdp.megatron.shape import from_weights
    full = "decoder.layers.1.mlp.experts.local_experts.12.linear_fc1.weight"
    assert expert_name(full) == ("decoder.layers.1.mlp.experts.", 12, "linear_fc1.weight")
    assert local_name(*expert_name(full)) == full
    assert expert_name("mlp.experts.local_experts.3.linear_fc2._extra_state") == (
        "mlp.experts.", 3, "linear_fc2._extra_state")
    for other in ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
                  "decoder.layers.1.mlp.router.weight", "decoder.layers.1.mlp.experts.weight1"):
        assert expert_name(other) is None
    state = {local_name("decoder.layers.0.mlp.experts.", j, f"linear_fc{i}.weight"):
             torch.zeros((12, 8) if i == 1 else (8, 6)) for j in range(3) for i in (1, 2)}
    assert set(stacked(state)) == {stacked_name("decoder.layers.0.mlp.experts.", rest)
                                   for rest in ("linear_fc1.weight", "linear_fc2.weight")}
    state["embedding.word_embeddings.weight"] = torch.zeros(64, 8)
    shape = from_weights(state)
    assert (shape["num_experts"], shape["moe_ffn_hidden_size"], shape["activation"]) == (
        3, 6, "swiglu")


def test_an_args_less_moe_checkpoint_routes_as_its_config_says(moe, tmp_path):
    """A torch_dist MoE checkpoint without Megatron-LM's args (Megatron-Bridge, NeMo 2): the
    routing of its TransformerConfig beside it (sigmoid scores, node-limited groups, scaled
    gates, the shared expert's gate) is read as Megatron-LM's arguments are, and the logits
    are megatron-core's."""
    import shutil

    import yaml

    from ptdp.megatron.checkpoint import from_megatron
    src = tmp_path / "bridge"
    shutil.copytree(moe["root"] / "dist", src)
    common = src / "iter_0000009" / "common.pt"
    torch.save({k: v for k, v in torch.load(common, weights_only=False).items() if k != "args"},
               common)
    args = moe["args"]
    config = dict(mc.transformer_config(args).__dict__, seq_length=args.seq_length,
                  rotary_base=args.rotary_base)
    fields = {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))}
    (src / "iter_0000009" / "run_config.yaml").write_text(yaml.safe_dump({"model": fields}))
    _, cfg, _ = from_megatron(src, tmp_path / "ptdp")
    m = cfg.model
    assert (m.moe_score_function, m.moe_renormalize, m.moe_routed_scaling_factor,
            m.moe_router_groups, m.moe_router_group_top_k) == ("sigmoid", True, 2.5, 2, 1)
    _close(LocalModel.from_checkpoint(tmp_path / "ptdp").logits(TOKENS), moe["logits"])
