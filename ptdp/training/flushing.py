"""One iteration of a flushing schedule (GPipe, 1F1B, interleaved, zero bubble).

Every micro-batch's forward and backward run (the executor plays this rank's steps), the
gradients are summed over the data group (overlapped with the last backward) and between the
tied embedding's copies, unscaled and clipped by the global norm, and AdamW steps the fp32
masters: after the flush, exactly the single-process update.
"""

from __future__ import annotations

import torch

from ptdp.data.batching import MicroBatches
from ptdp.optim.grads import global_grad_norm, reduce_sequence_parallel_grads
from ptdp.pipeline.schedules import build_all
from ptdp.runtime.trace import NO_SPANS
from ptdp.training.pipeline import Pipeline
from ptdp.training.results import StepResult, average_losses
from ptdp.training.state import TrainingState
from ptdp.training.updates import step_optimizer, unscale_


class FlushingStep:
    """An iteration in three parts the tests can also call one by one."""

    def __init__(self, state: TrainingState, pipeline: Pipeline, batches: MicroBatches):
        self.state, self.pipeline, self.batches = state, pipeline, batches
        # m -> this rank's steps, for every m the run goes through (a ramped batch changes m),
        # all built and checked under NCCL's rules at start-up, before the first iteration
        per_rank = state.cfg.train.micro_batch_size * state.grid.d
        self.plans = {batch // per_rank: self._plan(batch // per_rank)
                      for batch in state.batches.batch_sizes()}

    def _plan(self, m: int) -> list:
        par = self.state.cfg.parallel
        return self.pipeline.plan(build_all(self.state.cfg.schedule.name, par.pipeline,
                                            par.chunks, m))

    def start(self, first_iteration: int) -> None:
        """Nothing carries over between iterations of a flushing schedule."""

    def train_step(self, iteration: int, spans=NO_SPANS) -> StepResult:
        step = self.forward_backward(iteration, spans)
        step.grad_norm = self.reduce_gradients(spans)
        step.skipped = self.optimizer_step(iteration, step.grad_norm, spans)
        return step

    def forward_backward(self, iteration: int, spans=NO_SPANS) -> StepResult:
        """Every micro-batch's forward and backward; `spans` records their times."""
        state = self.state
        m = state.micro_batches(iteration)
        state.weights.zero_grads()
        for chunk in state.chunks.values():
            chunk.train()
        state.dp_grads.start_iteration(accumulations=m)
        result = self.pipeline.executor.run(
            self.plans[m], lambda mb: self.batches.get(iteration, mb),
            loss_scale=state.loss_scaler.scale / (m * state.grid.d), spans=spans)
        return average_losses(state, result, m)

    def reduce_gradients(self, spans=NO_SPANS) -> torch.Tensor:
        """Data-parallel and tied-embedding sums, loss-scale removal; returns the global norm
        (a device tensor: nothing here waits for the device)."""
        state, grid, weights = self.state, self.state.grid, self.state.weights
        with spans("data-parallel reduce", "reduce"):
            state.dp_grads.finish()
            weights.grads_to_masters()
        with spans("embedding reduce + norm", "reduce"):
            weights.sync_shared_embeddings(grid.embedding_group, len(grid.embedding_ranks))
            # sequence-parallel weights and QK-norm gains: partial over the tensor group
            reduce_sequence_parallel_grads(state.master_params, grid.group("tensor"), grid.t)
            unscale_([m.grad for m in state.master_params], state.loss_scaler.scale)
            return global_grad_norm(state.master_params, grid,
                                    sharded=weights.masters_are_pieces,
                                    device=state.device)

    def optimizer_step(self, iteration: int, grad_norm: torch.Tensor, spans=NO_SPANS) -> bool:
        """Clip and step; returns True if the step was skipped (fp16 overflow).

        Only fp16 reads the norm on the host (to decide the skip); otherwise clipping uses it
        on the device and a non-finite norm is caught once per iteration by the trainer.
        """
        state = self.state
        skipped = state.loss_scaler.dynamic and state.loss_scaler.update(float(grad_norm))
        if skipped:
            state.progress.skip(state.batches.batch_size(iteration))
        else:
            with spans("optimizer step", "optimizer"):
                step_optimizer(state.optimizer, state.master_params, iteration,
                               state.cfg.train, grad_norm, state.batches,
                               state.progress.skipped_samples)
                state.weights.masters_to_model()
        if state.experts is not None:   # the global batch's expert loads; the biases move
            state.experts.settle(stepped=not skipped)
        return skipped
