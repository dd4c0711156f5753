"""What the no-flush schedules (PipeDream-2BW, PipeDream async) share: one stream of iterations.

The schedule is one stream over the job (ptdp/pipeline/no_flush.py, ptdp/pipeline/window.py)
cut into iterations at its ``E`` actions. An iteration of the trainer is iteration t's steps:
on each rank from just after ``E(t-1)`` through ``E(t)``, where ``E(t)`` sits (by simulated
time) at the first action boundary after the last rank finished batch t. So ``train_step(t)``
returns batch t's loss and gradient norm, and the steps already hold the start of batch t+1
(1F1B never stops); the last iteration drains the pipeline. Metrics, validation and
checkpoints happen between iterations, where no exchange is in flight.

The executor hands the rank actions (R, W, U, T, E) to ``on_action``; the subclasses say what
they do (ptdp/training/two_bw.py, ptdp/training/pipedream.py). A no-flush step keeps the weight
versions, so it is also the training state's ``versions`` part: ``activate_newest()``, and what
a checkpoint saves of them (``state_dict()`` / ``load_state_dict()``, kept where
``state_part()`` says).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ptdp.checkpoint.layout import StatePart
from ptdp.data.batching import MicroBatches
from ptdp.optim.grads import counts_in_norm, reduce_sequence_parallel_grads
from ptdp.parallel.roles import writes
from ptdp.pipeline.actions import END, REDUCE, TIED, UPDATE, WEIGHTS
from ptdp.pipeline.weights import StashedVersions, take_gradients
from ptdp.training.pipeline import Pipeline
from ptdp.training.results import StepResult, mean_losses, sum_losses
from ptdp.training.state import TrainingState
from ptdp.training.updates import step_optimizer


class NoFlushStep:
    """The stream of iterations; subclasses say what the rank actions do."""

    CHECKPOINT_KEY = "versions"   # metadata.json's key for the versions' state (if any)

    def __init__(self, state: TrainingState, pipeline: Pipeline, batches: MicroBatches):
        self.state, self.pipeline, self.batches = state, pipeline, batches
        self.m, self.d = state.m, state.grid.d
        self.names = state.cfg.model.family.losses
        self.results: dict = {}      # iteration -> StepResult
        self.pending: dict = {}      # batch -> what R launched and W/E waits for
        self.plan = self.stream = None
        self.next = None
        self.versions: StashedVersions | None = None   # set by the subclass
        state.versions = self

    # The stream ------------------------------------------------------------------------------
    def start(self, first_iteration: int) -> None:
        """Plan iterations ``first_iteration .. train.iters - 1`` (checked under NCCL's rules)."""
        cfg = self.state.cfg
        iterations = cfg.train.iters - first_iteration
        self.next = first_iteration
        if iterations < 1:
            return
        self.plan = self.pipeline.no_flush_plan(cfg.schedule.name, first_iteration, iterations)
        batches = self.batches
        self.stream = self.pipeline.executor.stream(
            lambda mb: batches.get(mb // self.m, mb % self.m), self.loss_scale, self.on_action,
            versions=self.versions)

    def train_step(self, iteration: int, spans) -> StepResult:
        if iteration != self.next or self.stream is None:
            raise RuntimeError(f"{self.state.cfg.schedule.name} runs its iterations in order "
                               f"from the first planned one: expected iteration {self.next}, "
                               f"got {iteration}")
        for chunk in self.state.chunks.values():
            chunk.train()
        self.stream.run(self.plan.steps(self.state.grid.pp_rank, iteration), spans)
        if iteration == self.plan.first + self.plan.iterations - 1:
            self.stream.close()
        self.next += 1
        return self.results.pop(iteration)

    def on_action(self, action, stream) -> None:
        batch = action.mb // self.m
        if action.kind == REDUCE:
            self.reduce(batch, stream)
        elif action.kind == WEIGHTS:
            self.weights(batch)
        elif action.kind == UPDATE:
            self.update(action.mb)
        elif action.kind == TIED:
            self.tied(action.mb)
        elif action.kind == END:
            self.end(batch)
        else:
            raise ValueError(f"{type(self).__name__} cannot run {action}")

    def loss_scale(self, mb: int) -> float:
        return 1.0 / (self.m * self.d)

    # The versions part of the training state ----------------------------------------------------
    def activate_newest(self) -> None:
        """Point every parameter at the newest weights (validation, saving, reports)."""
        self.versions.activate_newest()

    def state_part(self) -> StatePart:
        """The versions as a checkpoint keeps them: per parameter (a version's weights) and in
        the metadata under CHECKPOINT_KEY."""
        return StatePart(self.CHECKPOINT_KEY, self, per_parameter=True)

    def state_dict(self) -> dict:
        """Nothing beyond the newest weights (the masters) by default."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore by default: the run refills the pipeline from the newest weights."""

    # Shared pieces ------------------------------------------------------------------------------
    def _take_reduced_gradients(self) -> list:
        """The data-parallel sums of what the parameters accumulated; the parameters are left
        without gradients."""
        self.state.dp_grads.finish()
        grid = self.state.grid   # QK-norm gains: partial over the tensor group (flushing.py)
        reduce_sequence_parallel_grads(self.state.params, grid.group("tensor"), grid.t)
        grads = take_gradients(self.state.params)
        self.state.dp_grads.start_iteration()
        return grads

    def _norm_squared(self, grads) -> torch.Tensor:
        """This rank's share of the model's gradient norm^2 (each parameter on the first rank
        of its reduce group only: the others hold the same gradient, and the report sums over
        every rank)."""
        state = self.state
        total = torch.zeros((), dtype=torch.float64, device=state.device)
        counted = [g.detach() for g, p in zip(grads, state.params)
                   if g is not None and counts_in_norm(p, state.grid.tp_rank)
                   and writes(p, state.grid)]
        if counted:
            total += torch.stack(torch._foreach_norm(counted)).double().pow(2).sum()
        return total

    def _launch_report(self, batch: int, stream, norm_squared: torch.Tensor):
        """All-reduce [norm^2, loss sum, aux sums] over every rank, asynchronously. Only the
        last stage's tensor rank 0 contributes losses (once per data rank)."""
        state = self.state
        taken = stream.take_losses(range(batch * self.m, (batch + 1) * self.m))
        if state.grid.tp_rank != 0:
            taken = []
        values = sum_losses([loss for loss, _ in taken], [aux for _, aux in taken], self.names,
                            state.device, extra=1)
        values[0] = norm_squared
        work = dist.all_reduce(values, async_op=True) if dist.get_world_size() > 1 else None
        return values, work

    def _report(self, values: torch.Tensor, norm: torch.Tensor, skipped: bool = False):
        loss, aux = mean_losses(values[1:], self.names, self.m * self.d)
        return StepResult(loss, aux, norm, skipped)

    def _step(self, masters, grads, lr_iteration: int, clip_norm=None):
        """An optimizer step over exactly ``masters`` (the others keep no gradient)."""
        state = self.state
        skipped = state.progress.skipped_samples   # (of the batches before this one)

        def step():
            for master, grad in zip(masters, grads):
                master.grad = grad
            step_optimizer(state.optimizer, masters, lr_iteration, state.cfg.train, clip_norm,
                           state.batches, skipped)
            for master in masters:
                master.grad = None
        return step

    def _tied_embeddings(self) -> bool:
        """The word table has a copy on another stage (tied embeddings, p > 1)."""
        return (self.state.cfg.model.word_table_on_last_stage
                and len(self.state.grid.embedding_ranks) > 1)
