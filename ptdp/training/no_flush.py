"""Training without pipeline flushes: PipeDream-2BW and PipeDream async (weight stashing).

The schedule is one stream over the job (``ptdp.pipeline.schedules``, ``ptdp.pipeline.window``)
cut into iterations at its ``E`` actions. An iteration of the trainer is iteration t's steps:
on each rank from just after ``E(t-1)`` through ``E(t)``, where ``E(t)`` sits (by simulated
time) at the first action boundary after the last rank finished batch t. So ``train_step(t)``
returns batch t's loss and gradient norm, and the steps already hold the start of batch t+1
(1F1B never stops); the last iteration drains the pipeline. Metrics, validation and
checkpoints happen between iterations, where no exchange is in flight.

This module is what the trainer does at the rank actions (the executor hands them over):

2BW (``TwoBW``), one weight version per batch, micro-batch k of batch t = k // m running with
version ``max(t - 1, 0)``: W(t+1) = W(t) - lr * AdamW(clip(grad f(W(t-1)))), Adam's moments fed
the delayed gradient.

* ``R(t)``, right after the rank's last backward of batch t: finish the data-parallel sums, take
  the gradients out of the parameters (batch t+1 accumulates afresh while they wait), unscale,
  sum the tied embedding's two copies (rank 0 finishes batch t last, so its all-reduce partner
  is always there), and launch one all-reduce over every rank of [norm^2, loss, aux].
* ``W(t)``: wait for it (already done: every rank ran its R(t) by then), decide the fp16 skip,
  clip by the global norm and step the fp32 masters into version t+1.
* ``E(t)``: the iteration boundary.

Holding batch t's gradients until every rank finished it (the global norm, fp16's overflow
check and the tied embedding need all of them) costs one extra gradient buffer on all but the
first pipeline rank, which reaches ``W(t)`` right after ``R(t)``.

PipeDream async (``PipeDream``), one update per input (a micro-batch on every data rank, their
gradients averaged: 1F1B-RR routes input i to data rank i mod d at every stage, so each data
rank is a replica of the whole pipeline):

* ``U(k)`` after ``B(k)``: data-parallel sum, then step this stage with input k's gradient. Weight
  stashing (default): F(k) ran with the newest version, so W(t+1) = W(t) - lr * grad f(W_1^(t-p+1),
  ..., W_p^(t)) (weight stashing). Vertical sync (``schedule.vertical_sync``): F(k) runs with the
  version input k was tagged with at the input stage, k - p + 1, on every stage: W(t+1) = W(t) -
  lr * grad f(W^(t-p+1)) (item 9).
* The tied word embedding belongs to stage 0's weights: rank 0 updates it at ``U(k)`` with the
  sum of both copies' gradients, and the last rank's copy gets the same update at ``T(k)``
  (right before F(k+p), which needs it), so both copies go through the same versions.
* ``R(t)``/``E(t)``: the iteration's report (loss; gradient norm = root mean square over the
  batch's inputs of the whole model's per-input gradient norm). No clipping (no global norm
  exists when stages update independently) and no fp16 (no common skip): refused in config.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ptdp.config.catalogue import schedule_spec
from ptdp.optim.grads import clip_gradients, counts_in_norm
from ptdp.optim.lr import learning_rate
from ptdp.pipeline.actions import END, REDUCE, TIED, UPDATE, WEIGHTS
from ptdp.pipeline.weights import StashedVersions, WeightVersions, take_gradients
from ptdp.pipeline.window import NoFlushPlan


class _NoFlush:
    """The stream of iterations; subclasses say what the rank actions do."""

    def __init__(self, trainer):
        self.tr = trainer
        self.m, self.d = trainer.m, trainer.grid.d
        self.results: dict = {}      # iteration -> StepResult
        self.pending: dict = {}      # batch -> what R launched and W/E waits for
        self.plan = self.stream = None
        self.next = None

    # The stream ------------------------------------------------------------------------------
    def start(self, first: int) -> None:
        """Plan iterations ``first .. train.iters - 1`` (checked under NCCL's rules)."""
        tr, cfg = self.tr, self.tr.cfg
        par = cfg.parallel
        iterations = cfg.train.iters - first
        self.next = first
        if iterations < 1:
            return
        self.plan = NoFlushPlan(cfg.schedule.name, par.pipeline, par.chunks, self.m, first=first,
                                iterations=iterations, shape_of=lambda message: tr.wire_shape)
        batches = tr.batches["train"]
        self.stream = tr.executor.stream(lambda mb: batches.get(mb // self.m, mb % self.m),
                                         self.loss_scale, self.on_action)

    def train_step(self, iteration: int, spans):
        if iteration != self.next or self.stream is None:
            raise RuntimeError(f"{self.tr.cfg.schedule.name} runs its iterations in order from "
                               f"the first planned one: expected iteration {self.next}, got "
                               f"{iteration}")
        for chunk in self.tr.chunks.values():
            chunk.train()
        self.stream.run(self.plan.steps(self.tr.grid.pp_rank, iteration), spans)
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

    # Shared pieces ------------------------------------------------------------------------------
    def _take_reduced_gradients(self) -> list:
        """The data-parallel sums of what the parameters accumulated; the parameters are left
        without gradients."""
        self.tr.dp_grads.finish()
        grads = take_gradients(self.tr.params)
        self.tr.dp_grads.start_iteration()
        return grads

    def _norm_squared(self, grads) -> torch.Tensor:
        """This rank's share of the model's gradient norm^2 (data rank 0 only: replicas hold
        the same gradients, and the report sums over every rank)."""
        tr = self.tr
        total = torch.zeros((), dtype=torch.float64, device=tr.device)
        counted = [g.detach() for g, p in zip(grads, tr.params)
                   if g is not None and counts_in_norm(p, tr.grid.tp_rank)]
        if counted and tr.grid.dp_rank == 0:
            total += torch.stack(torch._foreach_norm(counted)).double().pow(2).sum()
        return total

    def _launch_report(self, batch: int, stream, norm_squared: torch.Tensor):
        """All-reduce [norm^2, loss sum, aux sums] over every rank, asynchronously. Only the
        last stage's tensor rank 0 contributes losses (once per data rank)."""
        tr = self.tr
        names = self._aux_names()
        values = torch.zeros(2 + len(names), dtype=torch.float64, device=tr.device)
        values[0] = norm_squared
        taken = stream.take_losses(range(batch * self.m, (batch + 1) * self.m))
        if taken and tr.grid.tp_rank == 0:
            values[1:] += torch.stack([torch.stack([loss, *(aux[n] for n in names)]).double()
                                       for loss, aux in taken]).sum(0)
        work = dist.all_reduce(values, async_op=True) if dist.get_world_size() > 1 else None
        return values, work

    def _report(self, values: torch.Tensor, norm: torch.Tensor, skipped: bool = False):
        from ptdp.training import StepResult
        names = self._aux_names()
        scale = self.m * self.d
        return StepResult(values[1] / scale, {n: values[2 + i] / scale for i, n in enumerate(names)},
                          norm, skipped)

    def _aux_names(self) -> list[str]:
        return ["lm_loss", "sop_loss"] if self.tr.cfg.model.arch == "bert" else ["lm_loss"]

    def _step(self, masters, grads, lr_iteration: int, clip_norm=None):
        """An optimizer step over exactly ``masters`` (the others keep no gradient)."""
        tr = self.tr

        def step():
            for master, grad in zip(masters, grads):
                master.grad = grad
            if clip_norm is not None:
                clip_gradients(masters, tr.cfg.train.clip_grad, clip_norm)
            lr = learning_rate(lr_iteration, tr.cfg.train)
            for group in tr.optimizer.param_groups:
                group["lr"] = lr
            tr.optimizer.step()
            for master in masters:
                master.grad = None
        return step

    def _all_reduce_embedding(self, grad: torch.Tensor):
        grid = self.tr.grid
        return dist.all_reduce(grad, group=grid.embedding_group, async_op=True)

    def _tied_embeddings(self) -> bool:
        return len(self.tr.grid.embedding_ranks) > 1

    def activate_newest(self) -> None:
        self.tr.versions.activate_newest()


class TwoBW(_NoFlush):
    """PipeDream-2BW: double-buffered weights, delay-1 updates (module docstring)."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self.store = WeightVersions(trainer.params, trainer.master_params)
        self.oldest = 0          # batches before the oldest version fall back to it
        self.scales: dict[int, float] = {}   # batch -> fp16 loss scale its micro-batches use
        trainer.versions = StashedVersions([self.store], [self.version_of])

    def version_of(self, mb: int) -> int:
        """Micro-batch mb (0-based, global) runs with version max(mb // m - 1, 0)."""
        return max(mb // self.m - 1, self.oldest)

    def start(self, first: int) -> None:
        self.oldest = min(self.store.buffers)
        for batch in (first, first + 1):
            self.scales.setdefault(batch, self.tr.loss_scaler.scale)
        super().start(first)

    def loss_scale(self, mb: int) -> float:
        # fp16: a batch's scale is the scaler's after the update two batches back, fixed before
        # any of its micro-batches runs; its gradients are unscaled by the same value.
        return self.scales[mb // self.m] / (self.m * self.d)

    def reduce(self, batch: int, stream) -> None:
        grads = self._take_reduced_gradients()
        present = [g for g in grads if g is not None]
        scale = self.scales[batch]
        if scale != 1.0 and present:
            torch._foreach_div_(present, scale)
        tied = []
        if self._tied_embeddings():
            for param, grad in zip(self.tr.params, grads):
                if getattr(param, "shared_embedding", False) and grad is not None:
                    work = self._all_reduce_embedding(grad)
                    if getattr(param, "duplicate", False):
                        tied.append(work)   # the last stage's copy: needed only at W
                    else:
                        work.wait()         # rank 0 is the last to reach R: no wait in fact
        values, work = self._launch_report(batch, stream, self._norm_squared(grads))
        self.pending[batch] = (grads, values, work, tied)

    def weights(self, batch: int) -> None:
        tr = self.tr
        grads, values, work, tied = self.pending.pop(batch)
        for w in tied + ([work] if work is not None else []):
            w.wait()
        norm = values[0].sqrt()
        skipped = tr.loss_scaler.dynamic and tr.loss_scaler.update(float(norm))
        step = (lambda: None) if skipped else self._step(tr.master_params, grads, batch, norm)
        self.store.publish(step, lowest_needed=batch)   # batch's own version is done with
        self.scales[batch + 2] = tr.loss_scaler.scale
        self.results[batch] = self._report(values, norm, skipped)

    def end(self, batch: int) -> None:
        self.scales.pop(batch, None)

    # Checkpoints ---------------------------------------------------------------------------------
    def shadow(self):
        """(version id, tensors) of the older of the two live versions, if there is one."""
        versions = sorted(self.store.buffers)
        if len(versions) < 2:
            return None
        return versions[0], self.store.values(versions[0])

    def resume(self, iteration: int, shadow: list | None, scales: dict) -> None:
        """State after ``iteration`` iterations: masters are W(iteration); the shadow, if saved,
        is W(iteration - 1), which the next batch still uses."""
        self.store.renumber(iteration)
        if shadow is not None and iteration > 0:
            self.store.install(iteration - 1, shadow)
        self.scales.update({int(k): v for k, v in scales.items()})


class PipeDream(_NoFlush):
    """PipeDream async with weight stashing and optional vertical sync (module docstring)."""

    def __init__(self, trainer):
        super().__init__(trainer)
        tr = trainer
        self.vertical_sync = tr.cfg.schedule.vertical_sync
        self.p = tr.grid.p
        # the last stage's copy of the tied embedding has versions of its own (applied at T)
        is_copy = [bool(getattr(p, "duplicate", False)) for p in tr.params]
        self.own_index = [i for i, c in enumerate(is_copy) if not c]
        self.copy_index = [i for i, c in enumerate(is_copy) if c]
        self.own_masters = [tr.master_params[i] for i in self.own_index]
        self.own = WeightVersions([tr.params[i] for i in self.own_index], self.own_masters)
        groups, policies = [self.own], [self.own_version]
        self.copy = None
        if self.copy_index:
            self.copy = WeightVersions([tr.params[i] for i in self.copy_index],
                                       [tr.master_params[i] for i in self.copy_index])
            groups.append(self.copy)
            policies.append(lambda mb: self.copy.newest)
        self.first_update = 0    # updates done before this run's first input (a resume)
        self.norms: dict[int, torch.Tensor] = {}
        self.tied_pending: dict[int, tuple] = {}
        trainer.versions = StashedVersions(groups, policies)

    def start(self, first: int) -> None:
        self.first_update = first * self.m
        if self.own.newest != self.first_update:
            self.own.renumber(self.first_update)
            if self.copy is not None:
                self.copy.renumber(self.first_update)
        super().start(first)

    def input_version(self, mb: int) -> int:
        """The version input mb is tagged with at the input stage: the updates rank 0 made
        before F(mb), k - p + 1 in steady state (``schedules.weight_updates_before_forwards``)."""
        return self.first_update + max(mb - self.first_update - self.p + 1, 0)

    def loss_scale(self, mb: int) -> float:
        return 1.0 / self.d      # one input per update, averaged over the data ranks

    def own_version(self, mb: int) -> int:
        return self.input_version(mb) if self.vertical_sync else self.own.newest

    def update(self, mb: int) -> None:
        tr = self.tr
        grads = self._take_reduced_gradients()
        own = [grads[i] for i in self.own_index]
        if self._tied_embeddings():
            for i in range(len(grads)):
                param = tr.params[i]
                if getattr(param, "shared_embedding", False) and grads[i] is not None:
                    work = self._all_reduce_embedding(grads[i])
                    if getattr(param, "duplicate", False):
                        self.tied_pending[mb] = (work, grads[i])   # applied at T(mb)
                    else:
                        work.wait()   # the last rank ran U(mb) before: its part is there
        batch = mb // self.m
        self.norms[batch] = self.norms.get(batch, 0) + self._norm_squared(grads)
        nxt = tr.versions.last_forward + 1
        lowest = self.input_version(nxt) if self.vertical_sync else self.own.newest
        self.own.publish(self._step(self.own_masters, own, batch), lowest_needed=lowest)

    def tied(self, mb: int) -> None:
        work, grad = self.tied_pending.pop(mb)
        work.wait()
        masters = [self.tr.master_params[i] for i in self.copy_index]
        self.copy.publish(self._step(masters, [grad], mb // self.m),
                          lowest_needed=self.copy.newest)

    def reduce(self, batch: int, stream) -> None:
        norm_squared = self.norms.pop(batch, torch.zeros((), dtype=torch.float64,
                                                         device=self.tr.device))
        self.pending[batch] = self._launch_report(batch, stream, norm_squared)

    def end(self, batch: int) -> None:
        values, work = self.pending.pop(batch)
        if work is not None:
            work.wait()
        self.results[batch] = self._report(values, (values[0] / self.m).sqrt())


def build(trainer):
    """The no-flush training of ``trainer``'s schedule (2bw or pipedream)."""
    return PipeDream(trainer) if schedule_spec(trainer.cfg.schedule.name).update_per_input else TwoBW(trainer)
