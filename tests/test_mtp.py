"""Multi-token prediction (models/mtp.py): the depths' loss against a plain re-computation of
DeepSeek-V3's formula, every layout against one process (tests/equivalence.py) under NCCL's
rules, a checkpoint resumed in another layout, and bad input in one line each
(ptdp/config/mtp.py)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from ptdp.config import ConfigError, load_config
from tests.deadline import within
from tests.equivalence import MODELS, MOE, RTOL, TINY, assert_equivalent, run_layouts

# The MoE Llama of tests/test_moe_layouts.py on 4 layers, with two prediction depths (MoE
# layers, as the last decoder layer is): every side output at once, expert loads included
MTP = [*MOE, "model.num_layers=4", "model.mtp_layers=2", "model.mtp_loss_scale=0.3"]
# the same with a tied output layer: the last stage's word table is both the depths' embedding
# and the logits' (models/chunk.py)
TIED = [*MTP, "model.tie_embeddings=true"]

LAYOUTS = {
    "p2": (2, MTP, ["parallel.pipeline=2"]),
    "p2-tied": (2, TIED, ["parallel.pipeline=2"]),
    "t2-sp": (2, MTP, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
    "c2": (2, MTP, ["parallel.context=2"]),
    "e2-d2": (2, MTP, ["parallel.data=2", "parallel.expert=2"]),
    "p2-zb-h1": (2, MTP, ["parallel.pipeline=2", "schedule.name=zb-h1"]),
    "p2-recompute-full": (2, MTP, ["parallel.pipeline=2", "train.recompute=full"]),
    "p2-t2-sp-c2-interleaved": (8, MTP, ["parallel.pipeline=2", "parallel.chunks=2",
                                         "schedule.name=interleaved", "parallel.tensor=2",
                                         "parallel.sequence_parallel=true",
                                         "parallel.context=2"]),
}


@functools.lru_cache(maxsize=None)
def _results(world: int) -> dict:
    if world == 1:
        single, tied = run_layouts(1, [MTP, TIED], timeout_s=within(300))
        return {"single": single, "single-tied": tied}
    names = [n for n, (w, _, _) in LAYOUTS.items() if w == world]
    runs = run_layouts(world, [LAYOUTS[n][1] + LAYOUTS[n][2] for n in names],
                       timeout_s=within(600), nccl_rules=True)
    return dict(zip(names, runs))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_multi_token_prediction_layout_equals_one_process(layout):
    ref = _results(1)["single-tied" if LAYOUTS[layout][1] is TIED else "single"][0]
    assert {"mtp_1", "mtp_2", "moe_aux_loss"} <= set(ref["aux_losses"])
    assert ref["grads"]["mtp.1.layer.mlp.router.weight"].abs().sum() > 0   # the depths learn
    for rank, got in enumerate(_results(LAYOUTS[layout][0])[layout]):
        what = f"mtp {layout} rank {rank}"
        assert_equivalent(got, ref, what)
        assert got["expert_loads"].equal(ref["expert_loads"]), what   # the depths' too
        for name, value in ref["aux_losses"].items():
            assert abs(got["aux_losses"][name] - value) <= RTOL * abs(value), (what, name)


def _chunk_and_batch(*overrides):
    """A whole model (one chunk) and a micro-batch with the depths' targets."""
    from ptdp.data.batching import future_targets
    from ptdp.inference.local_model import build_single_stage
    cfg = load_config(None, TINY + MTP + list(overrides), world_size=1).model
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
             "loss_mask": (torch.rand(2, cfg.seq_length) > 0.2).float()}
    batch.update(future_targets(batch, cfg.mtp_layers))
    return cfg, build_single_stage(cfg, seed=3).train(), batch


def _reference_depth_losses(chunk, batch, depths: int) -> list[torch.Tensor]:
    """DeepSeek-V3's formula written out: depth k embeds token i + k, concatenates its norm with
    the norm of the previous depth's output, projects, runs its layer and final norm, and is
    scored on token i + k + 1 where it exists and its mask counts."""
    tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    s = tokens.shape[1]
    hidden = chunk.final_ln(chunk.stack(chunk.embedding(tokens), None))      # [s, b, h]
    table = chunk.output_table()[:chunk.ctx.model.vocab_size]   # the padding rows off
    losses = []
    for k, depth in enumerate(chunk.mtp, start=1):
        ahead = torch.zeros_like(tokens)
        ahead[:, :s - k] = tokens[:, k:]
        x = depth.eh_proj(torch.cat([depth.enorm(chunk.embedding(ahead)), depth.hnorm(hidden)],
                                    dim=-1))
        hidden = depth.final_ln(depth.stack.layers[0](x))
        per_token = F.cross_entropy((hidden @ table.t()).transpose(0, 1)[:, :s - k].flatten(0, 1),
                                    labels[:, k:].flatten(), reduction="none")
        weight = mask[:, k:].flatten()
        losses.append((per_token * weight).sum() / weight.sum())
    assert len(losses) == depths
    return losses


def test_each_depth_scores_the_token_k_plus_one_ahead_with_lambda_over_d():
    cfg, chunk, batch = _chunk_and_batch()
    out = chunk(None, batch)
    with torch.no_grad():
        expected = _reference_depth_losses(chunk, batch, cfg.mtp_layers)
    for k, loss in enumerate(expected, start=1):
        got = out.aux_losses[f"mtp_{k}"]
        assert torch.allclose(got, 0.3 / 2 * loss, rtol=1e-5), (k, got, loss)
    assert out.aux_losses["mtp_2"] != out.aux_losses["mtp_1"]


DENSE = [*MODELS["llama"], "model.mtp_layers=2"]


def _errors(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(None, TINY + DENSE + overrides, world_size=int(next(
            (o.split("=")[1] for o in overrides if o.startswith("parallel.pipeline=")), 1)))
    return err.value.errors


@pytest.mark.parametrize("overrides, line", [
    (["model.mtp_layers=-1"], "model.mtp_layers must be >= 0, got -1"),
    (["model.mtp_loss_scale=0"], "model.mtp_loss_scale must be positive, got 0"),
    (["model.position_embedding=learned"], "model.mtp_layers > 0 needs "
                                           "model.position_embedding=rope"),
    (["model.arch=bert", "model.preset=gpt"],
     "model.mtp_layers > 0 (multi-token prediction) applies to model.arch=gpt only"),
    (["parallel.pipeline=2", "schedule.name=2bw"],
     "model.mtp_layers > 0 needs a flushing schedule"),
])
def test_each_problem_is_one_line(overrides, line):
    errors = _errors(overrides)
    assert sum(line in e for e in errors) == 1, errors


def test_a_checkpoint_saved_at_p2_resumes_at_t2_with_sequence_parallelism(tmp_path):
    """Saved at p = 2 (the last stage's copy of the word table written once, the depths' MoE
    selection biases kept), resumed at t = 2 with sequence parallelism: the uninterrupted run's
    losses and weights."""
    from ptdp.runtime.local_ranks import run_on_ranks
    from tests.equivalence import relative_error
    from tests.features import resume_job
    runs = {"p2": MTP + LAYOUTS["p2"][2], "reshard": [("p2", "t2-sp")],
            "targets": {"t2-sp": MTP + LAYOUTS["t2-sp"][2]}}
    out = run_on_ranks(2, resume_job, str(tmp_path), runs, timeout_s=within(400))[0]
    straight, resharded = out["p2 straight"], out["p2 -> t2-sp"]
    assert len(resharded) == 2 and all(abs(x - y) <= RTOL * abs(y)
                                       for x, y in zip(resharded, straight[2:])), out
    assert out["p2 resumed"] == straight[2:]
    weights, expected = out["p2 -> t2-sp weights"], out["p2 straight weights"]
    assert weights.keys() == expected.keys() and "mtp.1.eh_proj.weight" in expected
    assert all(relative_error(weights[k], expected[k]) <= RTOL for k in expected)
