"""Multi-head latent attention (--multi-latent-attention --qk-layernorm) Megatron checkpoints
both ways, against megatron-core's own MLA GPT built and saved on CPU
(tests/megatron/mcore_models.py `mla_args`): YaRN with DeepSeek's mscale / mscale_all_dim and a
query latent, plain rope without one, and latent attention with the mixture of experts. Each
converts to ptdp with megatron-core's logits, and back into files megatron-core loads strictly
with the same logits; Megatron-LM's argument check passes with the printed flags.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from ptdp.inference.local_model import LocalModel  # noqa: E402
from tests.megatron import mcore_models as mc, megatron_lm  # noqa: E402

TOKENS = torch.randint(0, mc.VOCAB, (2, mc.SEQ), generator=torch.Generator().manual_seed(2))
VARIANTS = {
    "yarn": {},
    "rope": dict(q_lora_rank=None, rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0,
                 mscale_all_dim=0.0),
    "yarn_no_all_dim": dict(mscale=0.9, mscale_all_dim=0.0),   # cos/sin scaled, softmax not
}
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
           moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=False,
           moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
           moe_router_topk_scaling_factor=2.5, moe_router_pre_softmax=False,
           moe_grouped_gemm=False, moe_layer_freq=1, moe_router_num_groups=None,
           moe_router_group_topk=None, moe_aux_loss_coeff=0.01,
           moe_router_load_balancing_type="aux_loss")
def _args(variant: str):
    if variant == "moe":
        return mc.mla_args(**MOE)
    return mc.mla_args(**VARIANTS[variant])


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    with pytest.MonkeyPatch.context() as mp, mc.cpu_megatron(mp):
        out = {"root": root, "logits": {}}
        for seed, variant in enumerate([*VARIANTS, "moe"]):
            args = _args(variant)
            model = mc.build_gpt(args, seed=20 + seed)
            out["logits"][variant] = mc.gpt_logits(model, TOKENS)
            mc.save_legacy(model, args, root / f"{variant}_legacy", 7)
            mc.save_torch_dist(model, args, root / f"{variant}_dist", 7)
        yield out


def _close(ours, theirs) -> None:
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", [*VARIANTS, "moe"])
@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_megatron_mla_converts_with_megatron_cores_logits(mla, variant, fmt, tmp_path):
    from ptdp.megatron.checkpoint import from_megatron
    _, cfg, _ = from_megatron(mla["root"] / f"{variant}_{fmt}", tmp_path / "ptdp",
                              ["parallel.tensor=2"])
    m = cfg.model
    assert (m.mla_kv_lora_rank, m.head_dim, m.mla_rope_head_dim, m.mla_v_head_dim) == \
        (10, 6, 4, 5)
    assert m.mla_q_lora_rank == (0 if variant == "rope" else 12)
    assert m.rope_scaling_type == "yarn" or variant == "rope"
    model = LocalModel.from_checkpoint(tmp_path / "ptdp")
    _close(model.logits(TOKENS), mla["logits"][variant])


@pytest.mark.parametrize("variant", [*VARIANTS, "moe"])
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_ptdp_mla_loads_in_megatron_core(mla, variant, fmt, tmp_path):
    """ptdp -> Megatron: megatron-core's MLA GPT, built from the args the printed flags give,
    loads the written checkpoint strictly and computes the logits it came from."""
    from megatron.core import dist_checkpointing
    from ptdp.megatron.checkpoint import from_megatron, to_megatron_checkpoint
    from_megatron(mla["root"] / f"{variant}_dist", tmp_path / "ptdp")
    info = to_megatron_checkpoint(tmp_path / "ptdp", tmp_path / fmt, transformer_impl="local",
                                  ckpt_format=fmt)
    assert megatron_lm.assert_loads(info["directory"], info["load_flags"], mc.VOCAB) == 1
    flags = " ".join(info["load_flags"])
    assert "--multi-latent-attention --qk-layernorm" in flags
    assert "--kv-lora-rank 10 --qk-head-dim 6 --qk-pos-emb-head-dim 4 --v-head-dim 5" in flags
    assert ("--q-lora-rank" in flags) == (variant != "rope")
    written = info["args"]
    args = _args(variant)
    for name in mc.MLA_FIELDS:
        if variant == "rope" and name in ("mscale", "mscale_all_dim"):
            continue
        assert getattr(written, name, None) == getattr(args, name, None) or \
            name == "original_max_position_embeddings", name
    fresh = mc.build_gpt(args, seed=99)   # (megatron-core set up on CPU by the fixture)
    if fmt == "torch":
        mc.load_legacy_into(fresh, info["directory"])
    else:
        loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()},
                                         str(info["directory"]))
        fresh.load_state_dict(loaded["model"], strict=True)
    _close(mc.gpt_logits(fresh, TOKENS), mla["logits"][variant])


@pytest.mark.parametrize("change, says", [
    (dict(qk_layernorm=False), "--qk-layernorm"),
    (dict(rope_type="rope", rotary_scaling_factor=4.0), "softmax"),
    (dict(rotary_percent=0.5), "--rotary-percent"),
])
def test_mla_settings_ptdp_cannot_compute_are_refused(change, says):
    from ptdp.megatron.model_args import model_config
    from ptdp.megatron.errors import MegatronConversionError
    with pytest.raises(MegatronConversionError, match=says):
        model_config(mc.mla_args(**change), "gpt")


def test_ptdp_yarn_megatron_cannot_take_is_refused(mla, tmp_path):
    from ptdp.megatron.checkpoint import from_megatron, to_megatron_checkpoint
    from ptdp.megatron.errors import MegatronConversionError
    from_megatron(mla["root"] / "yarn_dist", tmp_path / "ptdp",
                  ["model.rope_original_seq_length=16"])
    with pytest.raises(MegatronConversionError, match="original_max_position_embeddings"):
        to_megatron_checkpoint(tmp_path / "ptdp", tmp_path / "out", transformer_impl="local")


@pytest.mark.parametrize("variant, fmt", [("yarn", "torch"), ("moe", "torch"),
                                          ("yarn", "torch_dist")])
def test_transformer_engine_names_read_back(mla, variant, fmt, tmp_path):
    """--transformer-impl transformer_engine: the latent norms fused into the up-projections,
    a dense layer's pre-MLP norm into fc1 (an MoE layer keeps its own), input_layernorm kept,
    the attention module's _extra_state; read back, the same weights."""
    from ptdp.megatron.checkpoint import from_megatron, read_megatron, to_megatron_checkpoint
    from_megatron(mla["root"] / f"{variant}_dist", tmp_path / "ptdp")
    info = to_megatron_checkpoint(tmp_path / "ptdp", tmp_path / "te", ckpt_format=fmt)
    back, local = read_megatron(tmp_path / "te"), read_megatron(mla["root"] / f"{variant}_dist")
    assert back["state"].keys() == local["state"].keys()
    assert all(torch.equal(back["state"][k], local["state"][k]) for k in back["state"])
    if fmt == "torch":
        saved = torch.load(info["directory"] / "mp_rank_00" / "model_optim_rng.pt",
                           weights_only=False)["model"]
        pre_mlp = "pre_mlp_layernorm.weight" if variant == "moe" else \
            "mlp.linear_fc1.layer_norm_weight"
        for name in ["self_attention.linear_q_up_proj.layer_norm_weight",
                     "self_attention.linear_kv_up_proj.layer_norm_weight",
                     "input_layernorm.weight", pre_mlp,
                     "self_attention.core_attention._extra_state"]:
            assert f"decoder.layers.1.{name}" in saved, name
        assert not any("q_layernorm" in k or "kv_layernorm" in k for k in saved)


def test_latent_legacy_split_over_tensor_ranks_is_refused(mla, tmp_path):
    from ptdp.megatron.checkpoint import from_megatron, to_megatron_checkpoint
    from ptdp.megatron.errors import MegatronConversionError
    from_megatron(mla["root"] / "yarn_dist", tmp_path / "ptdp")
    with pytest.raises(MegatronConversionError, match="tensor ranks"):
        to_megatron_checkpoint(tmp_path / "ptdp", tmp_path / "out", 2, ckpt_format="torch")
