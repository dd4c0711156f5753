"""A test-only chunk family with side outputs, trained by the executor or by one process.

Every stage boundary carries two tensors of different shapes: a hidden state h [s, b, H] and a
side channel c [s, b, K]. Every stage but the last adds `act_l2` = COEF * mean(h'^2) of the
hidden state it hands on; the last stage adds `head_l2` = COEF * mean(y^2) of its prediction.
The objective of a micro-batch is mean((y - target)^2) + the sum of every aux loss.

`train_pipelined` runs on the ranks of one pipeline (p ranks, the world group) with the
executor, the communication plan and the loss averaging the trainer uses; `train_single`
runs the same model (the same initial weights, data and SGD) in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ptdp.parallel.stage_output import StageOutput
from ptdp.config.catalogue import schedule_spec
from ptdp.pipeline.comm_plan import check_plans, plan_exchanges
from ptdp.pipeline.executor import PipelineExecutor
from ptdp.pipeline.p2p import P2P
from ptdp.pipeline.schedules import build_all
from ptdp.training.results import average_over

S, B, H, K = 4, 2, 8, 3       # sequence, micro-batch, hidden, side channel
COEF = 0.1
LR = 0.05
AUX_NAMES = ("act_l2", "head_l2")


def boundary_shapes(stage: int) -> tuple:
    return ((S, B, H), (S, B, K))


def _linear(generator: torch.Generator, n_in: int, n_out: int) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=generator) / n_in ** 0.5)
        layer.bias.copy_(torch.randn(n_out, generator=generator) * 0.1)
    return layer


class SideChunk(nn.Module):
    def __init__(self, stage: int, num_stages: int):
        super().__init__()
        g = torch.Generator().manual_seed(1000 + stage)
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.main = _linear(g, H, H)
        self.side = _linear(g, H, K)

    def forward(self, inputs, batch):
        h, c = (batch["x"], 0.0) if self.first else inputs
        h = torch.tanh(self.main(h))
        c = c + self.side(h)
        if self.last:
            loss = (c - batch["y"]).pow(2).mean()
            return StageOutput((loss, {}), {"head_l2": COEF * c.pow(2).mean()})
        return StageOutput((h, c), {"act_l2": COEF * h.pow(2).mean()})


def batch(iteration: int, mb: int) -> dict:
    g = torch.Generator().manual_seed(10_000 + 100 * iteration + mb)
    return {"x": torch.randn(S, B, H, generator=g), "y": torch.randn(S, B, K, generator=g)}


def _weights(chunks: dict) -> dict:
    return {f"{stage}.{name}": value.detach().clone()
            for stage, chunk in chunks.items() for name, value in chunk.state_dict().items()}


def train_single(num_stages: int, m: int, iters: int, with_aux: bool = True) -> dict:
    """One process: every micro-batch through every stage, objective / m backpropagated
    (`with_aux=False`: the main loss alone, to show that the aux losses matter)."""
    chunks = {s: SideChunk(s, num_stages) for s in range(num_stages)}
    optimizer = torch.optim.SGD([p for c in chunks.values() for p in c.parameters()], lr=LR)
    losses, aux = [], []
    for it in range(iters):
        optimizer.zero_grad()
        total, sums = 0.0, dict.fromkeys(AUX_NAMES, 0.0)
        for mb in range(m):
            out, objective = None, 0.0
            for stage in range(num_stages):
                result = chunks[stage](out, batch(it, mb))
                out = result.output
                for name, value in result.aux_losses.items():
                    sums[name] += value.item()
                    objective = objective + value if with_aux else objective
            loss = out[0]
            total += loss.item()
            ((loss + objective) * (1.0 / m)).backward()
        losses.append(total / m)
        aux.append({name: value / m for name, value in sums.items()})
        optimizer.step()
    return {"losses": losses, "aux": aux, "weights": _weights(chunks)}


def train_pipelined(runs: list[tuple], iters: int, nccl_rules: bool) -> list[dict]:
    """On every rank of a p-rank pipeline, for each (schedule, v, m) of `runs`: the averaged
    losses and aux losses per iteration (every rank holds them), and this rank's weights."""
    from tests.pipeline.nccl_rules import InOrderTransport
    p, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for schedule, v, m in runs:
        spec = schedule_spec(schedule)
        chunks = {s: SideChunk(s, p * v) for s in spec.stage_map(p, v).stages_of(rank)}
        transport = InOrderTransport() if nccl_rules else None
        executor = PipelineExecutor(chunks, p * v, P2P(list(range(p)), transport=transport),
                                    boundary_shapes=boundary_shapes,
                                    activation_dtype=torch.float32, device=torch.device("cpu"),
                                    aux_loss_names=AUX_NAMES)
        plans = plan_exchanges(build_all(schedule, p, v, m), p, v,
                               lambda msg: boundary_shapes(msg.boundary)[msg.index],
                               executor.tensors)
        check_plans(plans)
        optimizer = torch.optim.SGD([q for c in chunks.values() for q in c.parameters()], lr=LR)
        losses, aux = [], []
        for it in range(iters):
            optimizer.zero_grad()
            result = executor.run(plans[rank], lambda mb: batch(it, mb), loss_scale=1.0 / m)
            step = average_over(result, (), [(None, p)], m, torch.device("cpu")).resolve()
            losses.append(step.loss)
            aux.append(step.aux_losses)
            optimizer.step()
        out.append({"losses": losses, "aux": aux, "weights": _weights(chunks),
                    "batches": getattr(transport, "batches", None)})
    return out
