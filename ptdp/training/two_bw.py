"""PipeDream-2BW: double-buffered weights and delay-1 updates, without pipeline flushes.

One weight version per batch; micro-batch k of batch t = k // m runs with version
``max(t - 1, 0)``: W(t+1) = W(t) - lr * AdamW(clip(grad f(W(t-1)))), Adam's moments fed the
delayed gradient. The rank actions (ptdp/pipeline/no_flush.py):

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

Checkpoints: after N iterations the masters are W(N) and batch N still runs with W(N-1), the
shadow version; `state_dict()` gives it (with the fp16 loss scales fixed for batches N and
N+1), so a resumed run recomputes batch N with W(N-1) and continues the loss sequence of the
uninterrupted run exactly.
"""

from __future__ import annotations

from ptdp.checkpoint.layout import PARAMETERS
from ptdp.pipeline.weights import StashedVersions, WeightVersions
from ptdp.training.no_flush import NoFlushStep
from ptdp.training.updates import start_tied_embedding_sum, unscale_


class TwoBWStep(NoFlushStep):
    CHECKPOINT_KEY = "two_bw"

    def __init__(self, state, pipeline, batches):
        super().__init__(state, pipeline, batches)
        self.store = WeightVersions(state.params, state.master_params)
        self.oldest = 0          # batches before the oldest version fall back to it
        self.scales: dict[int, float] = {}   # batch -> fp16 loss scale its micro-batches use
        self.versions = StashedVersions([self.store], [self.version_of])

    def version_of(self, mb: int) -> int:
        """Micro-batch mb (0-based, global) runs with version max(mb // m - 1, 0)."""
        return max(mb // self.m - 1, self.oldest)

    def start(self, first_iteration: int) -> None:
        self.oldest = min(self.store.buffers)
        for batch in (first_iteration, first_iteration + 1):
            self.scales.setdefault(batch, self.state.loss_scaler.scale)
        super().start(first_iteration)

    def loss_scale(self, mb: int) -> float:
        # fp16: a batch's scale is the scaler's after the update two batches back, fixed before
        # any of its micro-batches runs; its gradients are unscaled by the same value.
        return self.scales[mb // self.m] / (self.m * self.d)

    def reduce(self, batch: int, stream) -> None:
        grads = self._take_reduced_gradients()
        unscale_(grads, self.scales[batch])
        tied = []
        if self._tied_embeddings():   # the last stage's copy is needed only at W
            tied = [work for _, work in start_tied_embedding_sum(
                self.state.params, grads, self.state.grid.embedding_group)]
        values, work = self._launch_report(batch, stream, self._norm_squared(grads))
        self.pending[batch] = (grads, values, work, tied)

    def weights(self, batch: int) -> None:
        state = self.state
        grads, values, work, tied = self.pending.pop(batch)
        for w in tied + ([work] if work is not None else []):
            w.wait()
        norm = values[0].sqrt()
        skipped = state.loss_scaler.dynamic and state.loss_scaler.update(float(norm))
        if skipped:   # W(t) come in order: the count holds the batches before the next one
            state.progress.skip(state.cfg.train.global_batch_size)
        step = (lambda: None) if skipped else self._step(state.master_params, grads, batch, norm)
        self.store.publish(step, lowest_needed=batch)   # batch's own version is done with
        self.scales[batch + 2] = state.loss_scaler.scale
        self.results[batch] = self._report(values, norm, skipped)

    def end(self, batch: int) -> None:
        self.scales.pop(batch, None)

    # Checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The older of the two live versions (per parameter, fp32 "shadow") and the fp16 loss
        scales already fixed for the coming batches; {} with one version."""
        versions = sorted(self.store.buffers)
        if len(versions) < 2:
            return {}
        first = self.state.progress.iteration
        return {"shadow_version": versions[0],
                "loss_scales": {str(b): s for b, s in self.scales.items() if b >= first},
                PARAMETERS: [{"shadow": t.float()} for t in self.store.values(versions[0])]}

    def load_state_dict(self, state: dict) -> None:
        """State after `progress.iteration` = N iterations: the masters are W(N); the shadow,
        if saved, is W(N - 1), which the next batch still uses (a checkpoint of another
        schedule has none: the first two batches then use the loaded weights)."""
        iteration = self.state.progress.iteration
        self.store.renumber(iteration)
        shadow = [entry.get("shadow") for entry in state.get(PARAMETERS, [])]
        if shadow and all(s is not None for s in shadow) and iteration > 0:
            self.store.install(iteration - 1, shadow)
        self.scales.update({int(k): v for k, v in state.get("loss_scales", {}).items()})
