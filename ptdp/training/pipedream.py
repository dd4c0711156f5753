"""PipeDream async with weight stashing: one update per input, without pipeline flushes.

An input is a micro-batch on every data rank, their gradients averaged: 1F1B-RR routes input i
to data rank i mod d at every stage, so each data rank is a replica of the whole pipeline. The
rank actions (ptdp/pipeline/no_flush.py):

* ``U(k)`` after ``B(k)``: data-parallel sum, then step this stage with input k's gradient. Weight
  stashing (default): F(k) ran with the newest version, so W(t+1) = W(t) - lr * grad f(W_1^(t-p+1),
  ..., W_p^(t)). Vertical sync (``schedule.vertical_sync``): F(k) runs with the version input k
  was tagged with at the input stage, k - p + 1, on every stage: W(t+1) = W(t) - lr *
  grad f(W^(t-p+1)).
* The tied word embedding belongs to stage 0's weights: rank 0 updates it at ``U(k)`` with the
  sum of both copies' gradients, and the last rank's copy gets the same update at ``T(k)``
  (right before F(k+p), which needs it), so both copies go through the same versions.
* ``R(t)``/``E(t)``: the iteration's report (loss; gradient norm = root mean square over the
  batch's inputs of the whole model's per-input gradient norm). No clipping (no global norm
  exists when stages update independently) and no fp16 (no common skip): refused in config.

Checkpoints save the newest weights only; a resumed run refills the pipeline, so its first p-1
inputs see fresher weights than they would have without the interruption.
"""

from __future__ import annotations

import torch

from ptdp.parallel.roles import role_of
from ptdp.pipeline.weights import StashedVersions, WeightVersions
from ptdp.training.no_flush import NoFlushStep
from ptdp.training.updates import start_tied_embedding_sum


class PipeDreamStep(NoFlushStep):
    def __init__(self, state, pipeline, batches):
        super().__init__(state, pipeline, batches)
        self.vertical_sync = state.cfg.schedule.vertical_sync
        self.p = state.grid.p
        # the last stage's copy of the tied embedding has versions of its own (applied at T)
        is_copy = [role_of(p).duplicate for p in state.params]
        self.own_index = [i for i, c in enumerate(is_copy) if not c]
        self.copy_index = [i for i, c in enumerate(is_copy) if c]
        self.own_masters = [state.master_params[i] for i in self.own_index]
        self.own = WeightVersions([state.params[i] for i in self.own_index], self.own_masters)
        groups, policies = [self.own], [self.own_version]
        self.copy = None
        if self.copy_index:
            self.copy = WeightVersions([state.params[i] for i in self.copy_index],
                                       [state.master_params[i] for i in self.copy_index])
            groups.append(self.copy)
            policies.append(lambda mb: self.copy.newest)
        self.first_update = 0    # updates done before this run's first input (a resume)
        self.norms: dict[int, torch.Tensor] = {}
        self.tied_pending: dict[int, tuple] = {}
        self.versions = StashedVersions(groups, policies)

    def start(self, first_iteration: int) -> None:
        self.first_update = first_iteration * self.m
        if self.own.newest != self.first_update:
            self.own.renumber(self.first_update)
            if self.copy is not None:
                self.copy.renumber(self.first_update)
        super().start(first_iteration)

    def input_version(self, mb: int) -> int:
        """The version input mb is tagged with at the input stage: the updates rank 0 made
        before F(mb), k - p + 1 in steady state (``weight_updates_before_forwards`` in
        ptdp/pipeline/no_flush.py)."""
        return self.first_update + max(mb - self.first_update - self.p + 1, 0)

    def loss_scale(self, mb: int) -> float:
        return 1.0 / self.d      # one input per update, averaged over the data ranks

    def own_version(self, mb: int) -> int:
        return self.input_version(mb) if self.vertical_sync else self.own.newest

    def update(self, mb: int) -> None:
        state = self.state
        grads = self._take_reduced_gradients()
        own = [grads[i] for i in self.own_index]
        if self._tied_embeddings():   # the last rank ran U(mb) before: its part is there
            for i, work in start_tied_embedding_sum(state.params, grads,
                                                    state.grid.embedding_group):
                self.tied_pending[mb] = (work, grads[i])   # applied at T(mb)
        batch = mb // self.m
        self.norms[batch] = self.norms.get(batch, 0) + self._norm_squared(grads)
        nxt = self.versions.last_forward + 1
        lowest = self.input_version(nxt) if self.vertical_sync else self.own.newest
        self.own.publish(self._step(self.own_masters, own, batch), lowest_needed=lowest)

    def tied(self, mb: int) -> None:
        if not self.copy_index:   # untied output layer: no copy to update
            return
        work, grad = self.tied_pending.pop(mb)
        work.wait()
        masters = [self.state.master_params[i] for i in self.copy_index]
        self.copy.publish(self._step(masters, [grad], mb // self.m),
                          lowest_needed=self.copy.newest)

    def reduce(self, batch: int, stream) -> None:
        norm_squared = self.norms.pop(batch, torch.zeros((), dtype=torch.float64,
                                                         device=self.state.device))
        self.pending[batch] = self._launch_report(batch, stream, norm_squared)

    def end(self, batch: int) -> None:
        values, work = self.pending.pop(batch)
        if work is not None:
            work.wait()
        self.results[batch] = self._report(values, (values[0] / self.m).sqrt())
