"""Multi-head latent attention (models/latent_attention.py): one layer against Hugging Face's
DeepseekV3Attention, every layout against one process (tests/equivalence.py), and bad input in
one line each (ptdp/config/latent.py)."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ptdp.config import ConfigError, load_config
from ptdp.models.transformer import ModelContext
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from tests.deadline import within
from tests.equivalence import MODELS, TINY, assert_equivalent, run_layouts
from tests.optional import needs

# DeepSeek-V3's attention at toy size: 4 heads of 8 (+ 4 rotary) query/key and 6 value values,
# a query latent of 16 and a key/value latent of 12 on h = 32
MLA = [*MODELS["llama"], "model.num_kv_heads=4", "model.head_dim=8",
       "model.mla_kv_lora_rank=12", "model.mla_q_lora_rank=16", "model.mla_rope_head_dim=4",
       "model.mla_v_head_dim=6"]


def _attention(*overrides: str):
    from ptdp.models.latent_attention import LatentAttention
    cfg = load_config(None, TINY + MLA + list(overrides), world_size=1)
    ctx = ModelContext(cfg.model, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")),
                       cfg.padded_vocab_size)
    return LatentAttention(ctx, 0, causal=True), cfg.model


def _interleaved(rows: torch.Tensor, rope: int) -> torch.Tensor:
    """Hugging Face's rotary rows (DeepSeek's interleaved pairs) of ptdp's (the halves): ptdp's
    [x_0 .. x_{r/2-1}, y_0 ..] are HF's [x_0, y_0, x_1, y_1, ..]."""
    head = rows.shape[0] - rope
    pairs = rows[head:].unflatten(0, (2, rope // 2)).transpose(0, 1).flatten(0, 1)
    return torch.cat([rows[:head], pairs])


def hugging_face_copy(ours, **keys):
    """transformers' DeepseekV3Attention of the toy's sizes (and `keys`) holding `ours`' weights:
    its rotary rows in DeepSeek's pairs, the latent norms' gains random in both."""
    transformers = needs("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf
    q_lora = ours.q_down.weight.shape[0] if ours.q_latent else None
    config = transformers.DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora,
        kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        attention_bias=False, **keys)
    config._attn_implementation = "eager"
    theirs = hf.DeepseekV3Attention(config, layer_idx=0)
    with torch.no_grad():
        if q_lora:
            theirs.q_a_proj.weight.copy_(ours.q_down.weight)
            theirs.q_a_layernorm.weight.copy_(torch.rand(16) + 0.5)
            ours.q_norm.weight.copy_(theirs.q_a_layernorm.weight)
            q_up, q_theirs = ours.q_up.weight, theirs.q_b_proj.weight
        else:
            q_up, q_theirs = ours.q.weight, theirs.q_proj.weight
        per_head = [_interleaved(rows, 4) for rows in q_up.view(4, 12, -1)]   # [head, rows, in]
        q_theirs.copy_(torch.stack(per_head).flatten(0, 1))
        theirs.kv_a_proj_with_mqa.weight.copy_(_interleaved(ours.kv_down.weight, 4))
        theirs.kv_a_layernorm.weight.copy_(torch.rand(12) + 0.5)
        ours.kv_norm.weight.copy_(theirs.kv_a_layernorm.weight)
        theirs.kv_b_proj.weight.copy_(ours.kv_up.weight)
        theirs.o_proj.weight.copy_(ours.proj.weight)
    return theirs, hf.DeepseekV3RotaryEmbedding(config)


@pytest.mark.parametrize("q_lora", [16, 0])
def test_a_layer_computes_hugging_faces_deepseek_v3_attention(q_lora):
    # (HF's latent norms keep their default eps, 1e-6, whatever rms_norm_eps says; ptdp's use
    # model.layernorm_eps, as Megatron's do: DeepSeek-V3's is 1e-6 for both)
    ours, m = _attention(f"model.mla_q_lora_rank={q_lora}", "model.layernorm_eps=1e-6")
    theirs, rotary = hugging_face_copy(ours, rms_norm_eps=m.layernorm_eps,
                                       max_position_embeddings=16)
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0))
    out, bias = ours(x)
    assert bias is None
    positions = torch.arange(16)[None].expand(2, -1)
    causal = torch.full((16, 16), float("-inf")).triu(1)[None, None].expand(2, 1, -1, -1)
    expected, _ = theirs(x.transpose(0, 1), rotary(x, positions), causal)
    torch.testing.assert_close(out.transpose(0, 1), expected, rtol=1e-5, atol=1e-6)


# Layouts of one world size share one spawned job; each is compared with one process.
LAYOUTS = {
    "t2": (2, ["parallel.tensor=2"]),
    "t2-sp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
    "d2": (2, ["parallel.data=2"]),
    "p2-zb-h1": (2, ["parallel.pipeline=2", "schedule.name=zb-h1"]),
    "p2-recompute-selective": (2, ["parallel.pipeline=2", "train.recompute=selective",
                                   "train.recompute_modules=[core_attn,layernorm]"]),
    # the context ring: V padded to the query/key heads' size, rotary positions per chunk
    "c2": (2, ["parallel.context=2"]),
    "t2-sp-c2": (4, ["parallel.tensor=2", "parallel.sequence_parallel=true",
                     "parallel.context=2"]),
    "p2-t2-sp-interleaved": (4, ["parallel.pipeline=2", "parallel.chunks=2",
                                 "schedule.name=interleaved", "parallel.tensor=2",
                                 "parallel.sequence_parallel=true"]),
}


def _world_results(world: int) -> dict:
    if world == 1:
        return {"single": run_layouts(1, [MLA], timeout_s=within(300))[0]}
    names = [n for n, (w, _) in LAYOUTS.items() if w == world]
    runs = run_layouts(world, [MLA + LAYOUTS[n][1] for n in names], timeout_s=within(600),
                       nccl_rules=True)
    return dict(zip(names, runs))


@functools.lru_cache(maxsize=None)
def _jobs() -> dict:
    """{world size: future of its results}: the one process's job and every world size's,
    started together (one job alone leaves cores idle: a single process uses one, the others
    wait on exchanges and start-up); their threads end with them."""
    pool = ThreadPoolExecutor(4, thread_name_prefix="latent")
    futures = {w: pool.submit(_world_results, w) for w in sorted({1, *(w for w, _ in LAYOUTS.values())})}
    pool.shutdown(wait=False)
    return futures


def _results(world: int) -> dict:
    return _jobs()[world].result()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_latent_attention_layout_equals_one_process(layout):
    ref = _results(1)["single"][0]
    assert any(".attention.kv_up." in name for name in ref["grads"])
    for rank, got in enumerate(_results(LAYOUTS[layout][0])[layout]):
        assert_equivalent(got, ref, f"latent attention {layout} rank {rank}")


def test_a_checkpoint_reshards_from_sequence_parallel_tensor_ranks_to_pipeline_stages(tmp_path):
    """Saved at t = 2 with sequence parallelism (replicated down-projections and latent norms
    written once), resumed at p = 2: the uninterrupted run's losses and weights."""
    from ptdp.runtime.local_ranks import run_on_ranks
    from tests.equivalence import RTOL, relative_error
    from tests.features import resume_job
    runs = {"t2-sp": MLA + LAYOUTS["t2-sp"][1], "reshard": [("t2-sp", "p2")],
            "targets": {"p2": MLA + ["parallel.pipeline=2"]}}
    out = run_on_ranks(2, resume_job, str(tmp_path), runs, timeout_s=within(400))[0]
    straight, resharded = out["t2-sp straight"], out["t2-sp -> p2"]
    assert len(resharded) == 2 and all(abs(x - y) <= RTOL * abs(y)
                                       for x, y in zip(resharded, straight[2:])), out
    assert out["t2-sp resumed"] == straight[2:]
    weights, expected = out["t2-sp -> p2 weights"], out["t2-sp straight weights"]
    assert weights.keys() == expected.keys()
    assert all(relative_error(weights[k], expected[k]) <= RTOL for k in expected)


def _errors(overrides: list[str]) -> list[str]:
    try:
        load_config(None, TINY + overrides, world_size=2)
    except ConfigError as err:
        return err.errors
    return []


@pytest.mark.parametrize("overrides, line", [
    (["model.mla_q_lora_rank=16"], "model.mla_q_lora_rank set while model.mla_kv_lora_rank = 0"),
    (["model.mla_v_head_dim=6"], "model.mla_v_head_dim set while model.mla_kv_lora_rank = 0"),
    (["model.mla_kv_lora_rank=12"], "model.mla_kv_lora_rank > 0 needs "
                                    "model.position_embedding=rope"),
    ([*MLA, "model.num_kv_heads=2"], "model.num_kv_heads (2) must equal model.num_heads (4) "
                                     "with latent attention"),
    ([*MLA, "model.mla_rope_head_dim=3"], "model.mla_rope_head_dim must be even"),
    ([*MLA, "model.qk_norm=true"], "model.qk_norm: not with latent attention"),
    ([*MLA, "model.arch=bert"], "model.mla_kv_lora_rank > 0 (latent attention) applies to "
                                "model.arch=gpt only"),
    ([*MLA, "parallel.context=2", "model.mla_v_head_dim=16"],
     "model.mla_v_head_dim (16) must be at most model.head_dim + model.mla_rope_head_dim = 12 "
     "with parallel.context=2"),
])
def test_each_problem_is_one_line(overrides, line):
    errors = _errors(overrides)
    assert any(e.startswith(line) for e in errors), errors
