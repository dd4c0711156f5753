"""Train a tiny model in several layouts on local gloo ranks and compare with one process.

The oracle (the project's test oracle): in fp32 with dropout 0, every layout must produce the
single-process loss sequence, gradients and updated weights to float32 round-off.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within

RTOL = 1e-5

# Small enough for 8 ranks on 2 cores, big enough to exercise every split: vocab 100 is
# padded to 128*t, 8 layers divide by p*v up to 8, 4 heads divide by t up to 4.
TINY = ["model.num_layers=8", "model.hidden_size=32", "model.num_heads=4",
        "model.seq_length=16", "model.vocab_size=100", "model.dropout=0.0",
        "train.micro_batch_size=2", "train.global_batch_size=8", "train.lr=1e-2",
        "train.clip_grad=1.0", "train.timeout_s=60", "train.seed=7",
        # AdamW divides by sqrt(v): it is blind to a gradient's scale, so an element whose
        # gradient is ~1e-5 of its tensor's (or exactly zero, like the key bias, whose float32
        # gradient is pure round-off) takes full-size steps driven by round-off, and two
        # single-process runs that merely sum in another order disagree at ~3e-5 (measured:
        # eps=1e-4 leaves t=4's fc2.bias at 1.03e-5, eps=1e-3 at 1.2e-6). eps=1e-3 keeps such
        # elements in Adam's linear regime; larger gradients are still normalised. Gradients
        # themselves are compared before any optimizer step, where no eps is involved.
        "train.adam_eps=1e-3"]


# Iterations each layout trains: the first step's losses and gradients, the loss after one
# update and the weights after two (Adam's moments carried over) are compared.
ITERS = 2


def train_and_collect(runs: list[list[str]], iters: int = ITERS,
                      nccl_rules: bool = False) -> list[dict] | None:
    """Runs on every rank; for each override list: losses, first-step grads, final weights.

    `nccl_rules` swaps in the transport that imposes NCCL's point-to-point rules on gloo.
    """
    from ptdp.config import load_config
    from ptdp.training import Trainer
    from tests.pipeline.nccl_rules import InOrderTransport

    collected = []
    for overrides in runs:
        held = _probe_held_outputs()
        cfg = load_config(None, TINY + overrides, world_size=dist.get_world_size())
        trainer = Trainer(cfg)
        grid, cp = trainer.state.grid, trainer.state.ctx.cp
        if nccl_rules:
            trainer.pipeline.p2p.transport = InOrderTransport(grid.group("pipeline"))
            if grid.c > 1:   # the context ring's exchanges under the same rules
                cp.transport = InOrderTransport(grid.group("context"))
        first = trainer.step.forward_backward(0)
        norm = trainer.step.reduce_gradients()
        grads = trainer.full_state(grads=True)
        trainer.step.optimizer_step(0, norm)
        first.grad_norm = norm
        norm = first.resolve().grad_norm
        losses = [first.loss] + [trainer.train_step(it).loss for it in range(1, iters)]
        weights = trainer.full_state()
        held.pop("restore")()
        collected.append({**held, "losses": losses, "grad_norm": norm, "grads": grads, "weights": weights,
                          "aux": first.aux, "aux_losses": first.aux_losses,
                          "expert_loads": getattr(trainer.state.experts, "total", None),
                          "bytes_sent": trainer.pipeline.p2p.bytes_sent,
                          "shards": {n: tuple(p.shape) for n, p in trainer.named_parameters()},
                          "coords": trainer.state.grid.coords,
                          "batches": getattr(trainer.pipeline.p2p.transport, "batches", None),
                          "ring_bytes": cp.bytes_sent,
                          "ring_batches": getattr(cp.transport, "batches", None)})
    return collected


def _probe_held_outputs() -> dict:
    """At this rank's first backward: the bytes of stage outputs it still holds (stashed for
    the backward, or in sends not yet complete), per micro-batch in flight, as
    {"held_per_mb": bytes}; "restore" undoes the probe."""
    from ptdp.pipeline import executor
    original, seen = executor._Run._backward, {}

    def probe(run, action):
        if "held_per_mb" not in seen:
            storages = {out.untyped_storage().data_ptr(): out.untyped_storage().nbytes()
                        for _, outputs, _, _ in run.stash.values() for out in outputs}
            storages.update((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                            for _, t in run.ex.p2p.pending_sends)
            seen["held_per_mb"] = sum(storages.values()) / len(run.stash)
        return original(run, action)

    executor._Run._backward = probe
    seen["restore"] = lambda: setattr(executor._Run, "_backward", original)
    return seen


def run_layouts(world_size: int, runs: list[list[str]], timeout_s: float = 240.0,
                nccl_rules: bool = False) -> list[list[dict]]:
    """[per run][per rank] results of `train_and_collect`."""
    per_rank = run_on_ranks(world_size, train_and_collect, runs, ITERS, nccl_rules,
                            timeout_s=within(timeout_s))
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(runs))]


# name -> (world size, overrides). Every layout is run for GPT and for BERT; layouts of one
# world size share one spawned job (process start-up dominates on 2 cores).
LAYOUTS = {
    "single":               (1, []),
    "t2":                   (2, ["parallel.tensor=2"]),
    "d2":                   (2, ["parallel.data=2"]),
    "p2-gpipe":             (2, ["parallel.pipeline=2", "schedule.name=gpipe"]),
    "p2-1f1b":              (2, ["parallel.pipeline=2", "schedule.name=1f1b"]),
    "t4":                   (4, ["parallel.tensor=4"]),
    "t2-d2":                (4, ["parallel.tensor=2", "parallel.data=2"]),
    "p4-v2-interleaved":    (4, ["parallel.pipeline=4", "parallel.chunks=2",
                                 "schedule.name=interleaved"]),
    "p2-t2-v2-sg":          (4, ["parallel.pipeline=2", "parallel.tensor=2", "parallel.chunks=2",
                                 "schedule.name=interleaved", "parallel.scatter_gather=true"]),
    "p2-t2-v2":             (4, ["parallel.pipeline=2", "parallel.tensor=2", "parallel.chunks=2",
                                 "schedule.name=interleaved"]),
    "p2-t2-recompute-full": (4, ["parallel.pipeline=2", "parallel.tensor=2", "train.recompute=full",
                                 "train.recompute_num_layers=2"]),
    "t2-d2-selective":      (4, ["parallel.tensor=2", "parallel.data=2",
                                 "train.recompute=selective"]),
    "t4-d2":                (8, ["parallel.tensor=4", "parallel.data=2"]),
    "p2-t2-d2-1f1b":        (8, ["parallel.pipeline=2", "parallel.tensor=2", "parallel.data=2"]),
    # The distributed optimizer (tests/optim/test_distributed_optimizer.py)
    "d2-distopt":           (2, ["parallel.data=2", "train.distributed_optimizer=true"]),
    "t2-d2-distopt":        (4, ["parallel.tensor=2", "parallel.data=2",  # 17 buckets
                                 "train.distributed_optimizer=true", "train.grad_bucket_mb=0.01"]),
    "p2-t2-d2-distopt":     (8, ["parallel.pipeline=2", "parallel.tensor=2", "parallel.data=2",
                                 "train.distributed_optimizer=true"]),
}
# The models every layout is checked with: GPT-2's block, BERT, and the Llama-style decoder
# (rotary positions, RMSNorm, SwiGLU, grouped-query attention with 2 K/V heads for 4 query
# heads, no biases, untied output layer).
MODELS = {
    "gpt": ["model.arch=gpt"],
    "bert": ["model.arch=bert"],
    "llama": ["model.arch=gpt", "model.preset=llama", "model.num_kv_heads=2",
              "model.ffn_hidden_size=64"],
    # The block options past the presets (docs/models.md), Gemma- and Qwen3-like: a head size
    # of 12 (Q is 48 wide on h = 32), QK-norm, zero-centred RMSNorm gains, GeGLU (the tanh
    # GeLU of the gate), embeddings scaled by sqrt(h), a tied output layer. Only in BLOCKS_LAYOUTS (and tests/parallel/test_context_parallel.py's
    # features), where it costs one run each.
    "blocks": ["model.arch=gpt", "model.preset=llama", "model.num_kv_heads=2",
               "model.ffn_hidden_size=64", "model.head_dim=12", "model.qk_norm=true",
               "model.norm_zero_centered=true", "model.activation=geglu",
               "model.scale_embeddings=true", "model.tie_embeddings=true"],
}
ARCHS = ("gpt", "bert", "llama")   # in every layout
BLOCKS_LAYOUTS = ("single", "p2-t2-v2", "t2-d2-selective")   # (p, t, v) and (t, d)
# A Llama-style mixture of experts (models/moe.py): 4 experts, top 2, every layer but the first,
# with both router losses, a gated shared expert and selection biases; its layouts are tests/test_moe.py's.
MOE = [*MODELS["llama"], "model.num_experts=4", "model.moe_top_k=2",
       "model.moe_ffn_hidden_size=32", "model.moe_first_dense_layers=1",
       "model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001",
       "model.moe_shared_ffn_hidden_size=16", "model.moe_shared_expert_gate=true",
       "model.moe_expert_bias_rate=0.01"]


def archs_for(layout: str) -> tuple[str, ...]:
    """Llama's 2 K/V heads split over at most t = 2 tensor ranks; the block options' model in
    BLOCKS_LAYOUTS only."""
    overrides = LAYOUTS[layout][1]
    archs = tuple(a for a in ARCHS if a != "llama" or "parallel.tensor=4" not in overrides)
    return archs + (("blocks",) if layout in BLOCKS_LAYOUTS else ())


def _world_results(world: int) -> dict:
    names = [n for n, (w, _) in LAYOUTS.items() if w == world]
    keys = [(n, arch) for n in names for arch in archs_for(n)]
    results = iter(run_layouts(world, [[*MODELS[arch], *LAYOUTS[n][1]] for n, arch in keys]))
    return {key: next(results) for key in keys}


_JOBS: dict = {}   # world size -> future of _world_results(world size)


def _results_of(world: int, with_the_others: bool) -> dict:
    """_world_results(world), spawned once. `with_the_others`: also start every other world
    size's job, all together (one job alone leaves cores idle: the single process uses one,
    the others wait on exchanges and start-up); the single process's alone otherwise (a module
    that only compares with it needs no other)."""
    sizes = sorted({w for w, _ in LAYOUTS.values()}) if with_the_others else [world]
    for size in sizes:
        if size not in _JOBS:
            pool = ThreadPoolExecutor(1, thread_name_prefix=f"equivalence-{size}")
            _JOBS[size] = pool.submit(_world_results, size)
            pool.shutdown(wait=False)   # its thread ends with the job
    return _JOBS[world].result()


def layout_result(name: str, arch: str) -> list[dict]:
    """Per-rank results of layout `name` for `arch` (cached; one spawn per world size)."""
    return _results_of(LAYOUTS[name][0], with_the_others=True)[(name, arch)]


def reference(arch: str) -> dict:
    return _results_of(1, with_the_others=False)[("single", arch)][0]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def assert_equivalent(got: dict, ref: dict, what: str) -> None:
    for i, (x, y) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(x - y) <= RTOL * abs(y), f"{what}: loss at iteration {i} is {x}, expected {y}"
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= RTOL * ref["grad_norm"], what
    for kind in ("grads", "weights"):
        assert got[kind].keys() == ref[kind].keys(), f"{what}: different {kind} names"
        for name, expected in ref[kind].items():
            actual = got[kind][name]
            assert actual.shape == expected.shape, f"{what}: {kind} {name} shape {actual.shape}"
            err = relative_error(actual, expected)
            assert err <= RTOL, f"{what}: {kind} of {name} differ by {err:.2e} (relative)"
