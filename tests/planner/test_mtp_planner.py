"""The planner on multi-token prediction (models/mtp.py; ptdp/planner/mtp.py, mtp_cost.py):
parameter counts against ptdp's real model (whole, and the last pipeline stage with its copy of
the word table) and DeepSeek-V3's MTP module, FLOPs against torch's FLOP counter and the formula
written out, what a depth keeps for backward against what it really saves, and the last stage's
memory, time, embedding sum, stage profile and search, with depths against without."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ptdp.config import load_config, padded_vocab_size
from ptdp.config.catalogue import schedule_spec
from ptdp.data.batching import future_targets
from ptdp.hardware import load_hardware
from ptdp.inference.local_model import build_single_stage
from ptdp.models import build_chunk
from ptdp.models.transformer import ModelContext
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from ptdp.planner import comm
from ptdp.planner.compute import ModelShape, head_times, layer_times
from ptdp.planner.cost_model import Layout, Workload, predict
from ptdp.planner.formulas import (active_parameters, decoder_parameters, iteration_flops,
                                   parameter_total)
from ptdp.planner.memory import GB, gpu_memory, layer_activation_bytes, stage_parameters
from ptdp.planner.moe import moe_layer_count
from ptdp.planner.mtp import depth_extra_bytes, depth_is_moe, mtp_expert_parameters
from ptdp.planner.mtp_cost import depth_head_times
from ptdp.planner.partitioner import split_stages
from ptdp.planner.search import search
from ptdp.planner.stage_plan import layer_profiles
from ptdp.profiler.timing import param_storages, saved_bytes
from tests.planner.test_latent_attention_planner import (DS_ATTENTION, DS_EXPERT, _deepseek_v3,
                                                         _flops_by_hand)

S, B, H = 16, 2, 32
TOY = ["model.arch=gpt", "model.preset=llama", "model.num_layers=4", "model.hidden_size=32",
       "model.num_heads=4", "model.seq_length=16", "model.vocab_size=100", "model.dropout=0.0"]
# MoE layers 1-3 (the depths' kind too), with a shared expert; "moe-dense-last" alternates from
# layer 0, so layer 3 and the depths are dense
MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=16",
       "model.moe_first_dense_layers=1", "model.moe_shared_ffn_hidden_size=8"]
KINDS = {"dense": [], "moe": MOE,
         "moe-dense-last": [*MOE, "model.moe_first_dense_layers=0", "model.moe_layer_freq=2"]}


def _model(kind="dense", depths=1, *overrides):
    return load_config(None, [*TOY, *KINDS[kind], f"model.mtp_layers={depths}", *overrides],
                       world_size=1).model


def _count(module, prefix="") -> int:
    return sum(p.numel() for n, p in module.named_parameters() if n.startswith(prefix))


def _active(module, m, prefix="") -> float:
    """The parameters a token passes: all but E - k of every MoE layer's E routed experts."""
    routed = sum(p.numel() for n, p in module.named_parameters()
                 if n.startswith(prefix) and ".mlp.experts." in n)
    skipped = (m.num_experts - m.moe_top_k) / m.num_experts if m.num_experts else 0
    return _count(module, prefix) - routed * skipped


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("depths", [1, 2])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_counts_equal_the_whole_model(kind, tie, depths):
    m = _model(kind, depths, f"model.tie_embeddings={str(tie).lower()}")
    shape = ModelShape.from_config(m)
    vocab = padded_vocab_size(m.vocab_size, 1)
    assert depth_is_moe(shape) == (kind == "moe")
    model = build_single_stage(m)
    total, depth = _count(model), _count(model, "mtp.")
    assert depth > 0
    assert decoder_parameters(shape, vocab) == parameter_total(shape, vocab) == total
    assert stage_parameters(shape, 1, 1, vocab, True, True) == total
    assert active_parameters(shape, vocab) == _active(model, m)
    without = dataclasses.replace(shape, mtp_layers=0)
    assert decoder_parameters(shape, vocab) - decoder_parameters(without, vocab) == depth
    assert (active_parameters(shape, vocab) - active_parameters(without, vocab)
            == _active(model, m, "mtp."))


def _context(m, t):
    return ModelContext(m, TensorParallel(group=None, rank=0, size=t), 7,
                        TensorParallelRNG(7, 0, torch.device("cpu")),
                        padded_vocab_size(m.vocab_size, t))


@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_last_stage_holds_the_depths_and_a_copy_of_the_word_table(kind, tie, t):
    """p = 2: the last stage's chunk holds the depths (their layers split by t, the rest whole)
    and, beside an untied output layer, a copy of the word table V h / t of its own."""
    m = _model(kind, 2, f"model.tie_embeddings={str(tie).lower()}")
    shape, vocab = ModelShape.from_config(m), padded_vocab_size(m.vocab_size, t)
    last = build_chunk(_context(m, t), 1, 2)
    assert stage_parameters(shape, t, 2, vocab, False, True) == _count(last)
    plain = build_chunk(_context(dataclasses.replace(m, mtp_layers=0), t), 1, 2)
    copy = 0 if tie else vocab * H // t   # a tied table's copy is there already
    assert _count(last) - _count(plain) == _count(last, "mtp.") + copy
    if kind == "dense":   # (MoE stages are priced at the busiest rank's MoE layers)
        first = build_chunk(_context(m, t), 0, 2)
        assert stage_parameters(shape, t, 2, vocab, True, False) == _count(first)


def test_the_depths_routed_experts_are_split_over_the_expert_ranks():
    shape = ModelShape.from_config(_model("moe", 2))
    expert = 3 * H * 16                  # a SwiGLU expert of 16: fc1 (gate, up) and fc2
    assert mtp_expert_parameters(shape, 1, 1) == 2 * 4 * expert
    assert mtp_expert_parameters(shape, 2, 4) == 2 * 4 * expert / 2 / 4
    assert mtp_expert_parameters(ModelShape.from_config(_model("moe-dense-last", 2)), 1, 1) == 0


def test_deepseek_v3s_mtp_module_is_an_moe_layer_with_its_projection_and_norms():
    """DeepSeek-V3's depth (its checkpoint's model.layers.61): a layer of the last decoder
    layer's kind, latent attention and 256 routed experts + 1 shared, 11,507,286,016 (DeepSeek's
    README_WEIGHTS.md: "11.5B unique parameters, excluding the shared 0.9B Embedding and 0.9B
    output Head"), plus eh_proj 2h^2 and enorm, hnorm, shared_head.norm: 11,610,067,968.
    Its checkpoint also stores the depth's own copies of embed_tokens and shared_head.head and
    its router's selection biases: 671,026,419,200 + 13,463,426,304 = 684,489,845,504 tensor
    elements; with the FP8 weights' scale tensors (one per 128 x 128 block of the attention
    and MLP weights, the MTP layer's included: 41,540,496) 684.53 B, Hugging Face's "685B"."""
    h, v = 7168, 129280
    shape = _deepseek_v3(mtp_layers=1)
    assert moe_layer_count(shape) == 58 + 1
    layer = DS_ATTENTION + 2 * h + 256 * h + 256 * DS_EXPERT + DS_EXPERT
    assert layer == 11_507_286_016
    depth = layer + 2 * h * h + 3 * h
    plain = _deepseek_v3()
    assert decoder_parameters(shape) - decoder_parameters(plain) == depth == 11_610_067_968
    assert decoder_parameters(shape) == 682_636_472_320
    active = DS_ATTENTION + 2 * h + 256 * h + 9 * DS_EXPERT + 2 * h * h + 3 * h
    assert active_parameters(shape) - active_parameters(plain) == active == 688_100_352
    assert 671_026_419_200 + depth + 2 * v * h + 256 == 684_489_845_504


# --------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------

def _batch(m):
    torch.manual_seed(0)
    tokens = torch.randint(0, m.vocab_size, (B, m.seq_length + 1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
             "loss_mask": torch.ones(B, m.seq_length)}
    return {**batch, **(future_targets(batch, m.mtp_layers) if m.mtp_layers else {})}


@pytest.mark.parametrize("depths", [0, 2])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_flop_formula_equals_the_counted_matmuls(kind, depths):
    """A forward and backward of the whole model, depths' losses included, under torch's FLOP
    counter, which sees neither the CPU's fused attention (its QK^T and AV: 3 x 4 B s^2 h a
    layer, as Eq. 4.2 counts them) nor the in-place addmm_ that adds the routed experts' up
    half to their input gradient (2 k T f_moe h an MoE layer, ptdp/parallel/experts.py): a
    depth's layer is counted as a decoder layer of its kind."""
    m = _model(kind, depths)
    shape = ModelShape.from_config(m)
    model = build_single_stage(m)
    with FlopCounterMode(display=False) as counter:
        out = model(None, _batch(m))
        aux = sum(out.aux_losses.values()) if hasattr(out, "aux_losses") else 0.0
        ((out.output if hasattr(out, "output") else out)[0] + aux).backward()
    assert not any("attention" in str(op) for op in counter.get_flop_counts()["Global"])
    layers = m.num_layers + depths
    unseen = 3 * layers * 4 * B * S * S * H + moe_layer_count(shape) * 2 * 2 * B * S * 16 * H
    assert counter.get_total_flops() + unseen == iteration_flops(
        shape, B, padded_vocab_size(m.vocab_size, 1), recompute_forward=False)


@pytest.mark.parametrize("recompute", [True, False])
def test_a_deepseek_v3_depth_costs_a_layer_its_projection_and_the_logits(recompute):
    """As Megatron's num_floating_point_operations (megatron/training/training.py): one more
    layer of the last one's kind (MoE), in Eq. 4.2's passes (full recomputation recomputes it),
    and eh_proj's 2 T 2h h and the logits' 2 T h V forward, 3 passes each. Megatron also counts
    the three norms, 3h multiply-adds a token; ptdp counts no norm."""
    shape = _deepseek_v3(mtp_layers=1)
    h, v, tokens = 7168, 129280, 8 * 4096
    passes = 4 if recompute else 3
    layers = _flops_by_hand(_deepseek_v3(layers=62), 8, v, passes)   # layer 61: MoE
    by_hand = layers + 3 * (2 * tokens * 2 * h * h + 2 * tokens * h * v)
    assert iteration_flops(shape, 8, recompute_forward=recompute) == pytest.approx(by_hand,
                                                                                    rel=1e-12)
    megatron_extra = 3 * 2 * tokens * (3 * h + 2 * h * h) + 3 * 2 * tokens * h * v
    assert by_hand - layers == pytest.approx(megatron_extra - 3 * 2 * tokens * 3 * h, rel=1e-12)


@pytest.mark.parametrize("windowed, local", [(None, 4 + 2), ([3], 1 + 2), ([0], 1)])
def test_a_depth_has_the_last_layers_window(windowed, local):
    window = ["model.sliding_window=8"] + (
        [f"model.sliding_window_layers=[{','.join(map(str, windowed))}]"] if windowed else [])
    assert ModelShape.from_config(_model("dense", 2, *window)).local_layers == local


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------

CPU = load_hardware("cpu-local")
LAYERNORM = ["model.preset=gpt", "model.position_embedding=rope", "model.tie_embeddings=false"]


def test_a_depth_keeps_what_the_planner_counts():
    """fp32 on CPU, LayerNorm and GeLU (whose eager kernels keep what fused ones do): each depth
    adds to what the whole model saves for backward its layer's stash (the CPU's fused
    attention) and depth_extra_bytes, the loss's fp32 softmax among them; the count is at or
    above it, within 10 %."""
    kept = []
    for depths in (0, 1, 2):
        m = _model("dense", depths, *LAYERNORM)
        model = build_single_stage(m).train()
        batch = _batch(m)
        kept.append(saved_bytes(lambda: model(None, batch), param_storages(model))[1])
    shape = ModelShape.from_config(m)
    planned = (layer_activation_bytes(shape, B, 1, "fp32", "none", "flash", hw=CPU)
               + depth_extra_bytes(shape, B, 1, 4, False, padded_vocab_size(100, 1), 4))
    assert kept[2] - kept[1] == kept[1] - kept[0] <= planned <= 1.1 * (kept[1] - kept[0])


def _memory(shape, rank, p=2, schedule="1f1b", recompute="none", m=8, hw=None, t=1, sp=False):
    return gpu_memory(shape, p=p, t=t, v=1, m=m, b=B, schedule=schedule, recompute=recompute,
                      precision="bf16", attention="flash", vocab_padded=padded_vocab_size(100, t),
                      reserved_gb=0.0, rank=rank, hw=hw, sequence_parallel=sp)


@pytest.mark.parametrize("schedule, held", [("1f1b", 1), ("gpipe", 8), ("zb-h1", 2)])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_last_stage_memory_grows_with_the_depths(schedule, held, recompute):
    """Weights, gradients and optimizer state by the last stage's parameters; activations by a
    depth's stash for each micro-batch the last stage holds (1F1B: one; GPipe: all m; ZB-H1:
    min(p, m), those waiting for their W pass counted whole); the first stage's unchanged."""
    shapes = [ModelShape.from_config(_model("dense", d, *LAYERNORM)) for d in (0, 1, 2)]
    last = [_memory(s, 1, schedule=schedule, recompute=recompute) for s in shapes]
    first = [_memory(s, 0, schedule=schedule, recompute=recompute) for s in shapes]
    assert first[0] == first[1] == first[2]
    vocab = padded_vocab_size(100, 1)
    params = [stage_parameters(s, 1, 2, vocab, False, True) for s in shapes]
    for got, n in zip(last, params):
        assert (got.weights, got.gradients, got.optimizer) == (2 * n, 4 * n, 12 * n)
    depth = (layer_activation_bytes(shapes[1], B, 1, "bf16", recompute, "flash")
             + depth_extra_bytes(shapes[1], B, 1, 2, False, vocab, 4))
    grown = [last[k + 1].activations - last[k].activations for k in (0, 1)]
    assert grown == pytest.approx([held * depth] * 2, rel=1e-12)
    assert last[1].buffers == last[0].buffers


def test_on_gpus_the_depths_keep_their_logits_in_the_models_dtype_and_sp_splits_the_rest():
    shape = ModelShape.from_config(_model("dense", 1, *LAYERNORM))
    h100 = load_hardware("h100-80gb")
    vocab, tokens = padded_vocab_size(100, 2), S * B
    cpu = _memory(shape, 1, t=2, recompute="full", hw=None).activations
    gpu = _memory(shape, 1, t=2, recompute="full", hw=h100).activations
    assert cpu - gpu == pytest.approx(tokens * vocab / 2 * (4 - 2))
    whole = _memory(shape, 1, t=2, recompute="full", hw=h100).activations
    split = _memory(shape, 1, t=2, recompute="full", hw=h100, sp=True).activations
    plain = dataclasses.replace(shape, mtp_layers=0)
    depth = [whole - _memory(plain, 1, t=2, recompute="full", hw=h100).activations,
             split - _memory(plain, 1, t=2, recompute="full", hw=h100, sp=True).activations]
    # full recomputation: the layer's input; then 5h a token of the rank's tokens
    assert depth[0] - depth[1] == pytest.approx((1 + 5) * tokens * H * 2 / 2)


def test_the_deepseek_v3_config_holds_its_depth_on_its_one_stage():
    """The config's layout, (p, t, d, e) = (1, 8, 256, 32), b = 15, full recomputation: the
    depth adds its weights, gradients and (sharded) optimizer state, its layer's input and its
    head's activations (the logits, [s b, V/8] in bf16, the largest)."""
    h100 = load_hardware("h100-80gb")
    shape = _deepseek_v3(mtp_layers=1)
    vocab = padded_vocab_size(129280, 8)
    kwargs = dict(p=1, t=8, v=1, m=1, b=15, schedule="1f1b", recompute="full",
                  precision="bf16", attention="flash", vocab_padded=vocab,
                  reserved_gb=0.0, rank=0, d=256, hw=h100, distributed_optimizer=True,
                  sequence_parallel=True, expert=32)
    got, plain = gpu_memory(shape, **kwargs), gpu_memory(_deepseek_v3(), **kwargs)
    tokens = 15 * 4096
    logits = tokens * vocab / 8 * 2
    assert got.activations - plain.activations == pytest.approx(
        tokens / 8 * 7168 * 2 * (1 + 5) + tokens * 7168 * 2 + logits)
    assert 3.2 < (got.activations - plain.activations) / GB < 3.3
    assert got.weights > plain.weights and got.optimizer > plain.optimizer


# --------------------------------------------------------------------------------------------
# Time, the embedding group, stages and search
# --------------------------------------------------------------------------------------------

def _work(shape, batch=16):
    return Workload(shape, batch, "bf16", 8)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_last_rank_runs_each_depth_as_a_layer_and_a_head(ideal, recompute):
    """p = 1, t = 2: per micro-batch a depth adds a layer's forward and backward (and its
    recomputation), enorm and hnorm, eh_proj (replicated: not split by t), the embedding and the
    head; its collectives are a layer's, the embedding's and the head's."""
    m = _model("dense", 1)
    shape = ModelShape.from_config(m)
    plain = dataclasses.replace(shape, mtp_layers=0)
    lay = Layout(1, 2, 1, 1, 2, "1f1b", recompute)
    with_depth, without = (predict(ideal, _work(s), lay) for s in (shape, plain))
    lt = layer_times(ideal, "bf16", shape, 2, 2, "flash")
    ht = head_times(ideal, "bf16", shape, 2, 2, padded_vocab_size(100, 2))
    tokens, e = 2 * S, 2
    proj = (3 * 2 * tokens * 2 * H * H) / (ideal.peak_flops("bf16") * ideal.efficiency.gemm_max)
    norms = 3 * 8 * tokens * H * e / (ideal.memory_bandwidth_GBps * 1e9 * ideal.efficiency.memory)
    head = ht.embed_forward + ht.embed_backward + ht.head_forward + ht.head_backward
    m_ = 8   # micro-batches: 16 / 2
    extra = with_depth.time["compute"] - without.time["compute"]
    assert extra == pytest.approx(m_ * (lt.forward + lt.backward
                                        + sum(depth_head_times(ideal, "bf16", shape, 2, 2, ht))))
    assert sum(depth_head_times(ideal, "bf16", shape, 2, 2, ht)) - head >= proj + norms
    redone = with_depth.time["recompute"] - without.time["recompute"]
    assert redone == pytest.approx(m_ * lt.forward if recompute == "full" else 0.0)
    link = comm.tensor_link(ideal, 2, 8, 2)
    ar = comm.all_reduce_time(2, tokens * H * e, link)   # an h-wide all-reduce
    layer = (4 + (2 if recompute == "full" else 0)) * ar
    head_comm = ar + 3 * comm.all_reduce_time(2, tokens * 4, link)   # the loss's reductions
    assert (with_depth.time["tensor_comm"] - without.time["tensor_comm"]
            == pytest.approx(m_ * (layer + ar + head_comm)))
    flops = iteration_flops(shape, 16, padded_vocab_size(100, 2),
                            recompute_forward=recompute == "full")
    assert with_depth.tflops_per_gpu * 1e12 * with_depth.step_time_s * 2 == pytest.approx(flops)


def test_an_moe_depth_adds_its_all_to_alls(a100):
    shape = ModelShape.from_config(_model("moe", 2))
    lay = Layout(1, 1, 4, 1, 1, "1f1b", "none", expert=4)
    with_depths = predict(a100, _work(shape), lay)
    without = predict(a100, _work(dataclasses.replace(shape, mtp_layers=0)), lay)
    per_layer = without.time["expert_all_to_all"] / 3   # layers 1-3 are MoE
    assert with_depths.time["expert_all_to_all"] == pytest.approx(5 * per_layer)


def test_untied_depths_sum_the_word_tables_copy_with_the_first_stage(a100):
    """With p > 1 an untied model's word table has a copy on the last stage for the depths'
    embeddings, summed with the first stage's in the embedding group as a tied table is."""
    lay = Layout(2, 1, 1, 1, 1, "1f1b", "none")
    untied = ModelShape.from_config(_model("dense", 0))
    assert not untied.tie_embeddings and not untied.word_table_on_last_stage
    depths = dataclasses.replace(untied, mtp_layers=1)
    tied = dataclasses.replace(untied, tie_embeddings=True)
    sync = [predict(a100, _work(s), lay).time["embedding_sync"] for s in (untied, depths, tied)]
    assert sync[0] == 0 and sync[1] == sync[2] > 0


def test_the_partitioner_sees_the_depths_on_the_last_stage(a100):
    """The last stage's profile holds the depths (a layer and a head each, recomputed as a
    layer); with depths enough it takes fewer layers than the others."""
    m = _model("dense", 0, "model.num_layers=8", "model.vocab_size=32")
    lay = Layout(2, 1, 1, 1, 1, "1f1b", "full")
    profiles = {d: layer_profiles(a100, _work(dataclasses.replace(
        ModelShape.from_config(m), mtp_layers=d)), lay) for d in (0, 3)}
    body, ht = profiles[3][1], head_times(a100, "bf16", ModelShape.from_config(m), 1, 1, 128)
    head = sum(depth_head_times(a100, "bf16", ModelShape.from_config(m), 1, 1, ht))
    assert profiles[3][-1].compute - profiles[0][-1].compute == pytest.approx(
        3 * (body.compute + head))
    assert split_stages(profiles[0], 2).stage_layers() == [4, 4]
    assert split_stages(profiles[3], 2).stage_layers()[1] < 4


def test_the_search_refuses_2bw_with_depths(a100):
    """The trainer adds the depths' losses (side outputs) with flushing schedules only."""
    shape = ModelShape.from_config(_model("dense", 1))
    assert not schedule_spec("2bw").flushing
    result = search(a100, _work(shape), 4, fixed={"pipeline": 2}, schedules=("1f1b", "2bw"))
    assert result.ranked and {p.layout.schedule for p in result.ranked} == {"1f1b"}
    only = search(a100, _work(shape), 4, fixed={"pipeline": 2, "schedule": "2bw"},
                  schedules=("2bw",))
    assert not only.ranked and "MTP" in only.rejected.examples["schedule rule"]
    plain = search(a100, _work(dataclasses.replace(shape, mtp_layers=0)), 4,
                   fixed={"pipeline": 2}, schedules=("1f1b", "2bw"))
    assert "2bw" in {p.layout.schedule for p in plain.ranked}


def test_a_plan_with_depths_differs_from_one_without(plan_json, model_file, capsys):
    from tests.planner.conftest import plan
    model = {"arch": "gpt", "preset": "llama", "num_layers": 4, "hidden_size": 256,
             "num_heads": 8, "seq_length": 512, "vocab_size": 32000, "dropout": 0.0}
    argv = ["--gpus", "8", "--global-batch-size", "32", "--fix", "p=2,t=2,b=1", "--top", "1"]
    plans = [plan_json(model_file({"model": {**model, "mtp_layers": d}}, f"m{d}.yaml"), *argv,
                       hardware="a100-80gb") for d in (0, 1)]
    shape = ModelShape.from_config(_model("dense", 1, "model.num_layers=4",
                                          "model.hidden_size=256", "model.num_heads=8",
                                          "model.seq_length=512", "model.vocab_size=32000"))
    extra = decoder_parameters(shape) - decoder_parameters(dataclasses.replace(shape,
                                                                               mtp_layers=0))
    assert plans[1]["model"]["parameters"] - plans[0]["model"]["parameters"] == extra
    assert plans[1]["model"]["mtp_layers"] == 1
    before, after = plans[0]["predicted"], plans[1]["predicted"]
    assert after["step_time_s"] > before["step_time_s"]
    assert after["memory_gb_per_gpu"] > before["memory_gb_per_gpu"]
    assert before["time_breakdown_s"]["embedding_sync"] == 0 < after["time_breakdown_s"][
        "embedding_sync"]
    assert plan([model_file({"model": {**model, "mtp_layers": 1}}), "--hardware", "a100-80gb",
                 *argv]) == 0
    assert "1 MTP depth)" in capsys.readouterr().out


def test_ptdp_check_names_the_depths_on_the_last_stage():
    from ptdp.planner.stage_plan import stage_lines
    cfg = load_config(None, [*TOY, "model.mtp_layers=2", "parallel.pipeline=2",
                             "parallel.stage_layers=[3,1]"], world_size=2)
    assert stage_lines(cfg)[-2:] == ["  stage 0: layers 0-2 + embedding",
                                     "  stage 1: layers 3-3 + output layer and loss + 2 MTP "
                                     "depth(s)"]
