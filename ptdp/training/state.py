"""The training state of one rank: what its steps work on and what a checkpoint saves of it.

`build_state` makes, for this rank's coordinates, the model chunks, the fp32 master weights,
AdamW, the loss scaler, the data-parallel gradient reduction and the random streams; every
rank builds the same objects for its coordinates, and nothing is global. The steps
(ptdp/training/flushing.py, two_bw.py, pipedream.py) work on this state, never on the trainer.

Each part that a checkpoint saves says what it saves and how it loads, with
`state_dict()` / `load_state_dict()` (the Stateful pattern of torch.distributed.checkpoint);
ptdp/checkpoint/ turns these into files and back, resharding in between:

=================  ==============================================  =========================
part               state_dict()                                    in the checkpoint
=================  ==============================================  =========================
weights            per parameter, its fp32 master (local shard)     "value" of each parameter
optimizer          per parameter, AdamW's moments and step          "exp_avg", "exp_avg_sq",
                                                                   "step"
loss_scaler        scale and good steps                            metadata "loss_scaler"
rng                CPU/CUDA and tensor-parallel streams            rng_rank{R}.pt
progress           iterations done (the data position and LR),     metadata "iteration",
                   samples of fp16-skipped updates (LR)            "skipped_samples"
versions           2BW: the older live weight version, fp16 scales  "shadow", metadata "two_bw"
=================  ==============================================  =========================

With the distributed optimizer the weights' and optimizer's state_dict() are collective over
the data group (each data rank holds a shard; ptdp/optim/distributed.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ptdp.checkpoint.layout import OPTIMIZER_KEYS
from ptdp.config import Config
from ptdp.config.batches import BatchSchedule
from ptdp.config.catalogue import ScheduleSpec
from ptdp.kernels import should_compile
from ptdp.models import ModelContext, build_chunk, named_global_parameters
from ptdp.optim.distributed import ShardedMasterWeights, shard_group
from ptdp.optim.grads import DataParallelGradients, counts_in_norm
from ptdp.optim.loss_scale import LossScaler
from ptdp.optim.mixed_precision import MasterWeights, PRECISIONS
from ptdp.optim.optimizer import build_optimizer
from ptdp.parallel.context import ContextParallel
from ptdp.parallel.grid import RankGrid
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import RandomStreams
from ptdp.parallel.roles import role_of, writes
from ptdp.parallel.sharding import gather_full_state
from ptdp.parallel.weight_grad import STORE as WEIGHT_GRADS
from ptdp.pipeline.actions import rank_stages
from ptdp.pipeline.weights import aliasing_masters


@dataclass
class Progress:
    """Iterations done: the next iteration to run, which fixes the data position, the batch
    size and the learning rate (pure functions of it: ptdp/config/batches.py, ptdp/optim/lr.py;
    a checkpoint records the consumed samples too)."""

    iteration: int = 0
    skipped_samples: int = 0   # samples of iterations whose fp16 update was skipped: the
                               # learning rate does not advance over them (as Megatron's)

    def skip(self, samples: int) -> None:
        """An iteration of `samples` whose update fp16 skipped."""
        self.skipped_samples += samples

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "skipped_samples": self.skipped_samples}

    def load_state_dict(self, state: dict) -> None:
        self.iteration = state["iteration"]
        self.skipped_samples = state.get("skipped_samples", 0)   # (older checkpoints: none)


class WeightState:
    """The model's weights as a checkpoint holds them: per parameter, its fp32 master."""

    def __init__(self, params: list, masters: list, weights):
        self.params, self.masters, self.weights = params, masters, weights

    def state_dict(self) -> list[torch.Tensor]:
        """Per parameter, its fp32 value, shaped like the parameter (this rank's shard)."""
        if self.weights.sharded:
            return self.weights.gather(self.weights.piece_values(lambda piece: piece.detach()))
        return [master.detach() for master in self.masters]

    @torch.no_grad()
    def load_state_dict(self, values: list[torch.Tensor]) -> None:
        """Masters from `values`; the model's (maybe low-precision) weights follow them."""
        if self.weights.sharded:   # whole local tensors into the model, ranges into the pieces
            for param, value in zip(self.params, values):
                param.copy_(value.view(param.shape))
            for piece in self.masters:
                piece.copy_(self.weights.range_of(piece, values[piece.param_index]))
            return
        for param, master, value in zip(self.params, self.masters, values):
            master.copy_(value)
            if param is not master:
                param.copy_(master)


class OptimizerState:
    """AdamW's state as a checkpoint holds it: per parameter its two moments and the step."""

    MOMENTS = OPTIMIZER_KEYS

    def __init__(self, optimizer: torch.optim.Optimizer, masters: list, weights):
        self.optimizer, self.masters, self.weights = optimizer, masters, weights

    def state_dict(self) -> list[dict]:
        """Per parameter {"exp_avg", "exp_avg_sq", "step"} (empty before the first step)."""
        if self.weights.sharded:
            step = self.weights.optimizer_step_count(self.optimizer)   # collective
            if step is None:
                return [{} for _ in self.weights.params]
            whole = {key: self.weights.gather(self.weights.piece_values(
                lambda piece, key=key: self.optimizer.state[piece][key])) for key in self.MOMENTS}
            return [{**{key: whole[key][i] for key in self.MOMENTS}, "step": step}
                    for i in range(len(self.weights.params))]
        out = []
        for master in self.masters:
            state = self.optimizer.state.get(master, {})
            out.append({key: torch.as_tensor(state[key]) for key in (*self.MOMENTS, "step")
                        if key in state})
        return out

    def load_state_dict(self, per_param: list[dict]) -> None:
        """Moments (whole local tensors per parameter) and step; a parameter without them keeps
        a fresh state. Through Optimizer.load_state_dict, so torch places and casts them."""
        sharded = self.weights.sharded
        by_master = {}
        for i, master in enumerate(self.masters):
            saved = per_param[master.param_index if sharded else i]
            if "step" not in saved or not all(key in saved for key in self.MOMENTS):
                continue
            moments = {key: (self.weights.range_of(master, saved[key]).clone()
                             if sharded else saved[key]) for key in self.MOMENTS}
            by_master[id(master)] = {"step": saved["step"].clone(), **moments}
        sd = self.optimizer.state_dict()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        sd["state"] = {index: by_master[id(p)] for index, p in enumerate(params)
                       if id(p) in by_master}
        self.optimizer.load_state_dict(sd)


@dataclass
class TrainingState:
    """Everything this rank's training steps work on (module docstring)."""

    cfg: Config
    grid: RankGrid
    device: torch.device
    tp: TensorParallel
    rng: RandomStreams
    ctx: ModelContext
    chunks: dict[int, nn.Module]          # global virtual stage -> model chunk
    params: list[nn.Parameter]            # this rank's parameters, chunk by chunk
    weights: MasterWeights | ShardedMasterWeights
    master_params: list[nn.Parameter]     # what the optimizer steps (same order as params)
    optimizer: torch.optim.Optimizer
    loss_scaler: LossScaler
    dp_grads: DataParallelGradients
    m: int                                # micro-batches per data rank and iteration (at B)
    batches: BatchSchedule                # each iteration's global batch (ramp-up)
    progress: Progress = field(default_factory=Progress)
    versions: object = None               # a no-flush step's weight versions (state_dict())

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.cfg.train.precision]

    def micro_batches(self, iteration: int) -> int:
        """Micro-batches per data rank in `iteration` (m, or fewer while the batch ramps up)."""
        return self.batches.batch_size(iteration) // (self.cfg.train.micro_batch_size * self.grid.d)

    def weight_state(self) -> WeightState:
        return WeightState(self.params, self.master_params, self.weights)

    def optimizer_state(self) -> OptimizerState:
        return OptimizerState(self.optimizer, self.master_params, self.weights)

    # Whole-model views (reports, tests, conversion) -----------------------------------------
    def named_parameters(self):
        """(global name, parameter) of this rank's chunks, as the single-process model names
        them."""
        for chunk in self.chunks.values():
            yield from named_global_parameters(chunk)

    def named_masters(self) -> list:
        """(global name of the model parameter, master) for each tensor the optimizer steps:
        one per parameter, or the distributed optimizer's pieces of this rank's shard."""
        names = [name for name, _ in self.named_parameters()]
        if self.weights.sharded:
            return [(names[m.param_index], m) for m in self.master_params]
        return list(zip(names, self.master_params))

    def full_state(self, grads: bool = False) -> dict:
        """Full fp32 weights (or the master weights' gradients) by global name, on every rank.
        Collective over the whole job."""
        if self.versions is not None:   # the newest version (the masters'), not the one in use
            self.versions.activate_newest()
        vocab = self.cfg.model.vocab_size
        if grads and self.weights.sharded:   # each data rank holds the sums of its shard only
            full = dict(zip(map(id, self.params), self.weights.full_grads()))
            return gather_full_state(self.named_parameters(), self.tp, vocab,
                                     value_of=lambda p: full[id(p)])
        if grads:
            pairs = [(name, master) for (name, _), master
                     in zip(self.named_parameters(), self.master_params)]
            return gather_full_state(pairs, self.tp, vocab, grads=True)
        return gather_full_state(self.named_parameters(), self.tp, vocab)

    def local_parameter_count(self) -> int:
        return sum(p.numel() for p in self.params if not role_of(p).duplicate)

    def total_parameter_count(self) -> int:
        """Whole-model parameters (padded vocabulary included), each weight counted once."""
        local = sum(p.numel() for p in self.params
                    if counts_in_norm(p, self.grid.tp_rank) and writes(p, self.grid))
        total = torch.tensor(local, dtype=torch.float64, device=self.device)
        if dist.get_world_size() > 1:   # (whole numbers: exact in any order)
            dist.all_reduce(total)
        return int(total.item())


def build_state(cfg: Config, grid: RankGrid, device: torch.device,
                spec: ScheduleSpec) -> TrainingState:
    """This rank's model chunks, masters, optimizer, loss scaler and gradient reduction."""
    par, tr = cfg.parallel, cfg.train
    rng = RandomStreams(tr.seed, grid.pp_rank, grid.tp_rank, device)
    tp = TensorParallel.from_grid(grid, par.sequence_parallel)
    ctx = ModelContext(cfg.model, tp, tr.seed, rng.tensor_parallel, cfg.padded_vocab_size,
                       tr.recompute, tr.recompute_num_layers,
                       compile=should_compile(tr.compile, device),
                       split_backward=spec.split_backward, cp=ContextParallel.from_grid(grid))
    WEIGHT_GRADS.clear()   # nothing deferred survives a previous trainer in this process
    num_stages = par.pipeline * par.chunks
    chunks = {s: build_chunk(ctx, s, num_stages).to(device, PRECISIONS[tr.precision])
              for s in rank_stages(grid.pp_rank, par.pipeline, par.chunks)}
    params = [p for c in chunks.values() for p in c.parameters()]
    weights, masters = _master_weights(cfg, grid, params, spec)
    m = cfg.num_micro_batches
    # PipeDream updates after every input: each parameter accumulates once per reduction.
    # Each summed over its role's axes (data ranks saw other sequences, context ranks other
    # tokens).
    dp_grads = DataParallelGradients(
        params, grid, 1 if spec.update_per_input else m,
        tr.grad_bucket_mb,
        flat=weights.flat_grads, sharded=weights if weights.sharded else None)
    return TrainingState(cfg, grid, device, tp, rng, ctx, chunks, params, weights, masters,
                         build_optimizer(masters, tr),
                         LossScaler(dynamic=tr.precision == "fp16", initial=tr.initial_loss_scale),
                         dp_grads, m, BatchSchedule.of(tr))


def _master_weights(cfg: Config, grid: RankGrid, params: list, spec: ScheduleSpec) -> tuple:
    """(MasterWeights or its sharded form, the masters the optimizer steps).

    Master weights come before the data-parallel reduction: their fp32-accumulation hook must
    run before the data-parallel one. Weight versions point parameters at tensors of their own,
    and 2BW holds one batch's gradients while the next accumulates: one storage per tensor
    then, not flat buffers; and in fp32 the optimizer must not step the parameter objects
    autograd saved (`aliasing_masters`).
    """
    tr = cfg.train
    if tr.distributed_optimizer:   # (config refuses it with the no-flush schedules)
        weights = ShardedMasterWeights(params, tr.precision, *shard_group(params, grid),
                                       tr.grad_bucket_mb)
        return weights, weights.masters
    weights = MasterWeights(params, tr.precision,
                            contiguous=False if spec.weight_versions else None)
    if spec.weight_versions:
        return weights, aliasing_masters(params, weights.masters)
    return weights, weights.masters
