"""The training state of one rank: what its steps work on and what a checkpoint saves of it.

`build_state` makes, for this rank's coordinates, the model chunks, the fp32 master weights,
AdamW, the loss scaler, the data-parallel gradient reduction and the random streams; every
rank builds the same objects for its coordinates, and nothing is global. The steps
(ptdp/training/flushing.py, two_bw.py, pipedream.py) work on this state, never on the trainer.

Each part that a checkpoint saves says what it saves and how it loads, with
`state_dict()` / `load_state_dict()` (the Stateful pattern of torch.distributed.checkpoint);
`TrainingState.parts()` lists them in load order, each as a `StatePart`
(ptdp/checkpoint/layout.py) saying where the format keeps it, and ptdp/checkpoint/ iterates
that list, turning parts into files and back, resharding in between:

===========  ===================================================  ============================
part         state_dict()                                         in the checkpoint
===========  ===================================================  ============================
progress     iterations done (the data position and LR),          metadata "iteration",
             samples of fp16-skipped updates (LR), samples read   "skipped_samples",
                                                                  "consumed_samples"
weights      per parameter, its fp32 master (local shard)         "value" of each parameter
optimizer    per parameter, AdamW's moments and step              "exp_avg", "exp_avg_sq",
                                                                  "step"
loss_scaler  scale and good steps                                 metadata "loss_scaler"
rng          CPU/CUDA and tensor-parallel streams                 rng_rank{R}.pt
versions     a no-flush step's weight versions; 2BW: the older    "shadow", metadata "two_bw"
             live version and its fixed fp16 scales
             (ptdp/training/two_bw.py)
moe          an MoE model's expert selection biases by layer      metadata "moe"
             (ptdp/training/experts.py)
===========  ===================================================  ============================

The weights and the optimizer part ask the master weights (ptdp/optim/weights.py) for whole
local tensors per parameter; with the distributed optimizer that is collective over the data
group (each data rank holds a shard; ptdp/optim/distributed.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ptdp.checkpoint.layout import PARAMETERS, StatePart
from ptdp.config import Config
from ptdp.config.batches import BatchSchedule
from ptdp.config.catalogue import ScheduleSpec
from ptdp.config.compilation import region_layers
from ptdp.kernels import should_compile
from ptdp.models import ModelContext, build_chunk, named_global_parameters
from ptdp.optim.distributed import ShardedMasterWeights, shard_group
from ptdp.optim.grads import DataParallelGradients, counts_in_norm
from ptdp.optim.loss_scale import LossScaler
from ptdp.optim.mixed_precision import MasterWeights, PRECISIONS
from ptdp.optim.optimizer import build_optimizer
from ptdp.optim.sharded_sets import ShardedSets
from ptdp.optim.weights import Weights
from ptdp.parallel.context import ContextParallel
from ptdp.parallel.experts import ExpertParallel
from ptdp.parallel.grid import RankGrid
from ptdp.parallel.initial_weights import drawing_in_threads
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import RandomStreams
from ptdp.parallel.roles import reduce_sets, role_of, writes
from ptdp.parallel.sharding import gather_full_state
from ptdp.training.experts import ExpertBiasState, ExpertLoads


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


class ProgressState:
    """The progress as a checkpoint holds it: with the samples consumed, for the record and
    for a resumed job's check of its batch sizes (ptdp/checkpoint/load.py)."""

    def __init__(self, progress: Progress, batches: BatchSchedule):
        self.progress, self.batches = progress, batches

    def state_dict(self) -> dict:
        return {**self.progress.state_dict(),
                "consumed_samples": self.batches.consumed(self.progress.iteration)}

    def load_state_dict(self, state: dict) -> None:
        self.progress.load_state_dict(state)


class WeightState:
    """The model's weights as a checkpoint holds them: per parameter, its fp32 "value"."""

    def __init__(self, weights: Weights):
        self.weights = weights

    def state_dict(self) -> dict:
        return {PARAMETERS: [{"value": v} for v in self.weights.state_dict()]}

    def load_state_dict(self, state: dict) -> None:
        self.weights.load_state_dict([entry["value"] for entry in state[PARAMETERS]])


class OptimizerState:
    """AdamW's state as a checkpoint holds it: per parameter its two moments and the step."""

    def __init__(self, optimizer: torch.optim.Optimizer, weights: Weights):
        self.optimizer, self.weights = optimizer, weights

    def state_dict(self) -> dict:
        return {PARAMETERS: self.weights.optimizer_state_dict(self.optimizer)}

    def load_state_dict(self, state: dict) -> None:
        """A parameter without saved moments (a converted checkpoint) keeps a fresh state."""
        self.weights.load_optimizer_state_dict(self.optimizer, state[PARAMETERS])


class StreamsState:
    """The random streams; a checkpoint of another layout (or without them) has no stream for
    this rank, and reusing the start-of-training seeds would repeat the first iterations'
    dropout masks: they are reseeded from the iteration instead."""

    def __init__(self, rng: RandomStreams, progress: Progress, seed: int):
        self.rng, self.progress, self.seed = rng, progress, seed

    def state_dict(self) -> dict:
        return self.rng.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.rng.load_state_dict(state)
        else:   # (the progress part loads first)
            self.rng.reseed(self.seed + 1_000_003 * self.progress.iteration)


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
    weights: Weights                      # their fp32 masters (ptdp/optim/weights.py)
    optimizer: torch.optim.Optimizer
    loss_scaler: LossScaler
    dp_grads: DataParallelGradients
    m: int                                # micro-batches per data rank and iteration (at B)
    batches: BatchSchedule                # each iteration's global batch (ramp-up)
    progress: Progress = field(default_factory=Progress)
    versions: object = None               # a no-flush step's weight versions (state_part())
    experts: ExpertLoads | None = None    # an MoE model's loads and selection biases

    @property
    def dtype(self) -> torch.dtype:
        return PRECISIONS[self.cfg.train.precision]

    @property
    def master_params(self) -> list[nn.Parameter]:
        """What the optimizer steps: one master per parameter, or the distributed optimizer's
        pieces of this rank's shard."""
        return self.weights.masters

    def micro_batches(self, iteration: int) -> int:
        """Micro-batches per data rank in `iteration` (m, or fewer while the batch ramps up)."""
        return self.batches.batch_size(iteration) // (self.cfg.train.micro_batch_size * self.grid.d)

    def parts(self) -> list[StatePart]:
        """What a checkpoint saves of this state, in load order: the progress first (the
        random streams and the weight versions are numbered from it)."""
        parts = [StatePart(None, ProgressState(self.progress, self.batches)),
                 StatePart("weights", WeightState(self.weights), per_parameter=True),
                 StatePart("optimizer", OptimizerState(self.optimizer, self.weights),
                           per_parameter=True),
                 StatePart("loss_scaler", self.loss_scaler),
                 StatePart("rng", StreamsState(self.rng, self.progress, self.cfg.train.seed),
                           per_rank=True)]
        if self.versions is not None:
            parts.append(self.versions.state_part())
        if self.experts is not None:
            parts.append(StatePart("moe", ExpertBiasState(self.experts)))
        return parts

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
        return [(names[i], master) for i, master
                in zip(self.weights.master_param_indices(), self.master_params)]

    def full_state(self, grads: bool = False) -> dict:
        """Full fp32 weights (or the master weights' gradients) by global name, on every rank.
        Collective over the whole job."""
        if self.versions is not None:   # the newest version (the masters'), not the one in use
            self.versions.activate_newest()
        vocab = self.cfg.model.vocab_size
        if grads:   # (sharded masters: each data rank holds the sums of its shard only)
            full = dict(zip(map(id, self.params), self.weights.full_grads()))
            return gather_full_state(self.named_parameters(), self.tp, vocab,
                                     value_of=lambda p: full[id(p)])
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
                       compile_layers=region_layers(cfg), cuda_graphs=tr.cuda_graphs,
                       cp=ContextParallel.from_grid(grid), ep=ExpertParallel.from_grid(grid),
                       recompute_modules=tr.recompute_modules)
    num_stages = par.pipeline * par.chunks
    with drawing_in_threads():   # the initial weights, drawn on this rank's share of the cores
        chunks = {s: build_chunk(ctx, s, num_stages, par.stage_layers)
                  for s in spec.stage_map(par.pipeline, par.chunks).stages_of(grid.pp_rank)}
    chunks = {s: chunk.to(device, PRECISIONS[tr.precision]) for s, chunk in chunks.items()}
    params = [p for c in chunks.values() for p in c.parameters()]
    weights = _master_weights(cfg, grid, params, spec)
    m = cfg.num_micro_batches
    # PipeDream updates after every input: each parameter accumulates once per reduction.
    # Each summed over its role's axes (data ranks saw other sequences, context ranks other
    # tokens).
    dp_grads = DataParallelGradients(
        params, grid, 1 if spec.update_per_input else m,
        tr.grad_bucket_mb,
        flat=weights.flat_grads, sharded=weights.shard_layout,
        reduce_dtype=tr.grad_reduce_dtype)
    state = TrainingState(cfg, grid, device, tp, rng, ctx, chunks, params, weights,
                          build_optimizer(weights.masters, tr),
                          LossScaler(dynamic=tr.precision == "fp16", initial=tr.initial_loss_scale),
                          dp_grads, m, BatchSchedule.of(tr))
    if cfg.model.num_experts:
        state.experts = ExpertLoads(state)
    return state


def _master_weights(cfg: Config, grid: RankGrid, params: list, spec: ScheduleSpec) -> Weights:
    """Replicated master weights, or sharded with the distributed optimizer.

    Master weights come before the data-parallel reduction: their fp32-accumulation hook must
    run before the data-parallel one. A schedule that keeps weight versions needs one storage
    per tensor and masters apart from the parameter objects (`versioned`).
    """
    tr = cfg.train
    if tr.distributed_optimizer and len(reduce_sets(params)) > 1:   # experts apart (e > 1)
        return ShardedSets(params, tr.precision, grid, tr.grad_bucket_mb)
    if tr.distributed_optimizer:   # (config refuses it with the no-flush schedules)
        return ShardedMasterWeights(params, tr.precision, *shard_group(params, grid),
                                    tr.grad_bucket_mb)
    return MasterWeights(params, tr.precision, versioned=spec.weight_versions)
