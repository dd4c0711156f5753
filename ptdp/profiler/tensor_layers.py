"""Tensor-parallel layers on busy CPU ranks: what communication really adds to a layer.

`ptdp profile` (ptdp/profiler/kernels.py) times a layer shard's compute in one process and the
collectives on their own. On CPU ranks a layer's collectives cost far more than those two
predict together: every all-reduce waits for the slowest member of its group, and gloo's
transport threads compete with the computing ranks for the same cores. Measured here (2 cores,
GPT h512 s128 b2, t = 2): 2.3 ms per all-reduce inside a layer against 0.6 ms for the same
all-reduce alone.

So for each world of busy ranks, each t and b, with and without sequence parallelism, this
runs a stack of layers twice in the same run, every rank at once: with the real tensor group,
and with each rank in a group of its own that claims size t (the same shapes, no
communication). The difference of the median wall times, per layer, is the communication as a
layer sees it: the rows of `measured.tensor_layers`, which the cost model
(ptdp/planner/cost_model.py) uses in place of its ring formula when they match the shape.
"""

from __future__ import annotations

import statistics
import time

from ptdp.planner.formulas import ModelShape

LAYERS = 2   # a stack, so the comm between layers is the trainer's


def _wall(fn) -> float:
    import torch.distributed as dist
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _paired_extra(real, alone, iters: int, warmup: int = 2) -> tuple[float, float]:
    """(median of real, median of real - alone) wall seconds, the two run in turns so that a
    burst of load from elsewhere hits both alike."""
    for _ in range(warmup):
        real(), alone()
    pairs = [(_wall(real), _wall(alone)) for _ in range(iters)]
    return (statistics.median(r for r, _ in pairs),
            statistics.median(max(r - a, 0.0) for r, a in pairs))


def _stack_pass(model_cfg, tp, b: int, precision: str):
    """A closure running forward + backward through a LAYERS-deep stack with group `tp`."""
    import dataclasses

    import torch
    from ptdp.models.transformer import TransformerStack
    from ptdp.profiler.timing import DTYPES, layer_context
    dtype = getattr(torch, DTYPES[precision])
    m, cpu = model_cfg, torch.device("cpu")
    ctx = dataclasses.replace(layer_context(m, tp.size, cpu), tp=tp)
    stack = TransformerStack(ctx, 0, LAYERS, m.family.causal).to(cpu, dtype)
    stack.train()
    seq = m.seq_length // tp.size if tp.sequence_parallel else m.seq_length
    x = torch.randn(seq, b, m.hidden_size, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    return lambda: stack(x).backward(grad)


def _layer_comm(model_cfg, real_tp, alone_tp, b: int, precision: str, iters: int) -> dict:
    """One layer's forward+backward wall seconds with `real_tp`, and what that exceeds the
    same layer without communication (`alone_tp`) by. Only the sum: split into forward and
    backward, the difference drowns in the noise of a busy node."""
    real = _stack_pass(model_cfg, real_tp, b, precision)
    alone = _stack_pass(model_cfg, alone_tp, b, precision)
    both, extra = _paired_extra(real, alone, iters)
    return dict(layer_s=both / LAYERS, comm_s=extra / LAYERS)


def bench_tensor_layers(model: dict, tensors: list[int], micro_batches: list[int],
                        precision: str, iters: int) -> list[dict]:
    """Runs on every rank of a run_on_ranks world; rank 0's rows are the result."""
    import torch.distributed as dist
    from ptdp.config import ModelConfig
    from ptdp.parallel.grid import axis_rows, grid_layout, new_groups
    from ptdp.parallel.mappings import TensorParallel
    rank, world = dist.get_rank(), dist.get_world_size()
    model_cfg = ModelConfig(**model)
    alone_groups = new_groups([[r] for r in range(world)])   # every rank makes every group
    rows = []
    for t in (t for t in tensors if t > 1 and world % t == 0):
        groups = new_groups(axis_rows(grid_layout(1, world // t, t), ["tensor"]))
        alone = TensorParallel(alone_groups[rank], 0, t)
        for sequence_parallel in (False, True):
            real = TensorParallel(groups[rank // t], rank % t, t, sequence_parallel)
            for b in micro_batches:
                rows.append(dict(hidden=model_cfg.hidden_size, heads=model_cfg.num_heads,
                                 ffn=model_cfg.ffn_hidden_size, seq=model_cfg.seq_length,
                                 precision=precision, tensor=t, micro_batch=b, world=world,
                                 sequence_parallel=sequence_parallel,
                                 **ModelShape.from_config(model_cfg).block_key(),
                                 **_layer_comm(model_cfg, real, alone, b, precision, iters)))
    return rows


def measure_tensor_layers(model_cfg, tensors: list[int], micro_batches: list[int],
                          precision: str, worlds: list[int], threads: int, iters: int,
                          log=print) -> list[dict]:
    """`measured.tensor_layers`: bench_tensor_layers on each world of busy ranks."""
    import dataclasses

    from ptdp.runtime.local_ranks import run_on_ranks
    model = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(model_cfg)}
    rows = []
    for world in worlds:
        if not any(t > 1 and world % t == 0 for t in tensors):
            continue
        found = run_on_ranks(world, bench_tensor_layers, model, tensors, micro_batches,
                             precision, iters, timeout_s=900.0, threads=threads)[0]
        rows += found
        for row in found:
            log(f"  {world} busy ranks, t={row['tensor']} b={row['micro_batch']}"
                f"{' sp' if row['sequence_parallel'] else ''}: layer {row['layer_s'] * 1e3:.1f} ms, "
                f"of which tensor comm {row['comm_s'] * 1e3:.2f} ms")
    return rows
