"""The FLOP and parameter formulas against the real models: GPT's Eq. 4.2 and BERT's own
formula equal what torch's FLOP counter sees in a forward + backward pass, and BERT's
parameter count equals the model's; the trainer reports TFLOP/s with the architecture's formula."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ptdp.models import build_chunk
from ptdp.models.transformer import ModelContext
from ptdp.config import ModelConfig, config_from_dict
from ptdp.data.synthetic import synthetic_datasets
from ptdp.metrics.throughput import iteration_tflops
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from ptdp.planner.compute import ModelShape
from ptdp.planner.formulas import bert_parameter_count, model_flops
from ptdp.planner.memory import stage_parameters

L, H, A, S, V, B = 2, 32, 4, 16, 128, 3


def _chunk(arch):
    cfg = ModelConfig(arch=arch, num_layers=L, hidden_size=H, num_heads=A, seq_length=S,
                      vocab_size=V, dropout=0.0)
    ctx = ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")), V)
    return cfg, build_chunk(ctx, 0, 1)


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_flop_formula_equals_the_counted_matmuls(arch):
    cfg, chunk = _chunk(arch)
    data = synthetic_datasets(cfg, 3)["train"]
    batch = torch.utils.data.default_collate([data[i] for i in range(B)])
    with FlopCounterMode(display=False) as counter:
        loss = chunk(None, batch)
        (loss[0] if isinstance(loss, tuple) else loss).backward()
    counted = counter.get_total_flops()
    ops = {str(op) for op in counter.get_flop_counts()["Global"]}
    if not any("attention" in op for op in ops):
        # torch's counter does not see the CPU SDPA kernel: add its QK^T and AV matmuls,
        # forward and backward (3 x 4 B s^2 h per layer), as Eq. 4.2 counts them.
        counted += 3 * L * 4 * B * S * S * H
    assert counted == model_flops(arch, B, S, L, H, V, recompute_forward=False)


def test_bert_parameters_equal_the_model():
    cfg, chunk = _chunk("bert")
    params = sum(p.numel() for p in chunk.parameters())
    assert bert_parameter_count(L, H, V, S, cfg.num_tokentypes) == params
    shape = ModelShape("bert", L, H, A, 4 * H, S, V, False)
    assert stage_parameters(shape, 1, 1, V, True, True) == params


def test_trainer_tflops_use_the_bert_formula():
    raw = {"model": {"arch": "bert", "num_layers": L, "hidden_size": H, "num_heads": A,
                     "seq_length": S, "vocab_size": V},
           "train": {"micro_batch_size": 1, "global_batch_size": B}}
    cfg = config_from_dict(raw)
    expected = model_flops("bert", B, S, L, H, cfg.padded_vocab_size, False) / 2.0 / 1 / 1e12
    assert iteration_tflops(cfg, 2.0, 1) == pytest.approx(expected)
    gpt = config_from_dict({**raw, "model": {**raw["model"], "arch": "gpt"}})
    assert iteration_tflops(gpt, 2.0, 1) < iteration_tflops(cfg, 2.0, 1)
