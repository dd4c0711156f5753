"""`ptdp config from-megatron` with multi-head latent attention's arguments
(ptdp/megatron/latent_flags.py): the model keys a command line translates to are the ones the
same run's checkpoint converts to (ptdp/megatron/latent.py), what megatron-core would compute
otherwise is refused and stops the translation, and the usual-attention flags MLA ignores are
ignored."""

from __future__ import annotations

import pytest

from ptdp.config import ModelConfig
from ptdp.megatron.model_args import model_config
from ptdp.megatron.translate import translate
from tests.megatron import mcore_models as mc

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
        "--lr", "1e-4", "--train-iters", "10", "--position-embedding-type", "rope",
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--multi-latent-attention", "--qk-layernorm",
        "--kv-lora-rank", "10", "--qk-head-dim", "6", "--qk-pos-emb-head-dim", "4",
        "--v-head-dim", "5"]
LATENT_KEYS = ("mla_kv_lora_rank", "mla_q_lora_rank", "head_dim", "mla_rope_head_dim",
               "mla_v_head_dim", "num_kv_heads", "rope_scaling_type", "rope_scaling_factor",
               "rope_original_seq_length", "rope_yarn_mscale", "rope_yarn_mscale_all_dim",
               "rope_yarn_attention_factor", "rope_yarn_beta_fast", "rope_yarn_beta_slow")


def _model(values: dict) -> ModelConfig:
    keys = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith("model.")}
    return ModelConfig(**keys)


@pytest.mark.parametrize("flags, args", [
    (["--q-lora-rank", "12", "--rotary-scaling-factor", "4", "--mscale", "0.8",
      "--mscale-all-dim", "0.6"], mc.mla_args()),
    (["--rope-type", "rope"], mc.mla_args(q_lora_rank=None, rope_type="rope",
                                          rotary_scaling_factor=1.0, mscale=1.0,
                                          mscale_all_dim=0.0)),
    (["--q-lora-rank", "12", "--rotary-scaling-factor", "4", "--mscale", "0.9"],
     mc.mla_args(mscale=0.9, mscale_all_dim=0.0)),
])
def test_flags_translate_to_the_checkpoints_model(flags, args):
    out = translate(BASE + flags)
    assert not out.blocking
    ours, converted = _model(out.values), model_config(args, "gpt")
    assert {k: getattr(ours, k) for k in LATENT_KEYS} == \
        {k: getattr(converted, k) for k in LATENT_KEYS}
    assert ours.qk_norm is False


def test_latent_flags_are_ignored_without_latent_attention():
    out = translate([w for w in BASE if w not in ("--multi-latent-attention",)])
    assert "model.mla_kv_lora_rank" not in out.values
    assert out.values.get("model.qk_norm") is True
    assert any(line.argument.startswith("--kv-lora-rank") and line.kind == "ignored"
               for line in out.lines)


@pytest.mark.parametrize("drop, add, says", [
    ("--qk-layernorm", [], "not normalised"),
    (None, ["--rope-type", "rope", "--rotary-scaling-factor", "4", "--mscale-all-dim", "0.6"],
     "softmax"),
])
def test_what_ptdp_cannot_compute_stops_the_translation(drop, add, says):
    out = translate([w for w in BASE if w != drop] + add)
    assert [line.why for line in out.blocking if says in line.why]


def test_usual_attention_flags_mla_ignores():
    out = translate(BASE + ["--kv-channels", "8", "--use-rope-scaling"])
    assert out.values["model.head_dim"] == 6 and "model.rope_scaling_factor" not in out.values
    ignored = {line.argument.split()[0] for line in out.lines if line.kind == "ignored"}
    assert {"--kv-channels", "--use-rope-scaling"} <= ignored
