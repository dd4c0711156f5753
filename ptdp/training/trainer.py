"""The training loop: build the rank's model chunks, run the schedule, reduce, step, log.

One iteration = one global batch: the executor runs this rank's action list (forwards and
backwards of every micro-batch), gradients are summed over the data group (overlapped with
the last backward) and between the tied embedding copies, unscaled and clipped by the global
norm, and AdamW steps on fp32 master weights. Every rank builds the same objects for its
coordinates; nothing is global.

The no-flush schedules (2bw, pipedream) keep the pipeline running across iterations and keep
weight versions; `ptdp.no_flush` says how their iterations map onto the stream and what
happens at their reduction and update actions. They run whole iterations only (`train_step`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ptdp.models import ModelContext, build_chunk, named_global_parameters
from ptdp.data.batching import MicroBatches
from ptdp.config import Config
from ptdp.data.synthetic import synthetic_datasets
from ptdp.kernels import should_compile
from ptdp.metrics.log import MetricsLog, write_config
from ptdp.metrics.report import end_summary, format_bytes, startup_report
from ptdp.metrics.throughput import iteration_tflops, peak_memory_gb, peak_tflops
from ptdp.optim.distributed import ShardedMasterWeights
from ptdp.optim.grads import (DataParallelGradients, clip_gradients, counts_in_norm,
                              global_grad_norm, reduce_sequence_parallel_grads,
                              sync_shared_embeddings)
from ptdp.optim.loss_scale import LossScaler
from ptdp.optim.lr import learning_rate
from ptdp.optim.mixed_precision import PRECISIONS, MasterWeights
from ptdp.optim.optimizer import build_optimizer
from ptdp.parallel.grid import coordinates_of
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG, seed_everything
from ptdp.pipeline.comm_plan import check_plans, plan_exchanges
from ptdp.pipeline.executor import PipelineExecutor
from ptdp.pipeline.p2p import P2P
from ptdp.parallel.weight_grad import STORE as WEIGHT_GRADS
from ptdp.pipeline.actions import FORWARD, rank_stages
from ptdp.config.catalogue import FORWARD_ONLY, schedule_spec
from ptdp.pipeline.schedules import build_all
from ptdp.pipeline.weights import aliasing_masters
from ptdp.runtime.startup import init_distributed
from ptdp.runtime.trace import NO_SPANS, TraceRecorder
from ptdp.runtime.watchdog import Watchdog, is_communication_error
from ptdp.parallel.sharding import gather_full_state


@dataclass
class StepResult:
    """One iteration's statistics. `forward_backward` and `reduce_gradients` leave them as
    device tensors (no host sync inside the step); `resolve()` reads them all at once."""

    loss: torch.Tensor | float
    aux: dict
    grad_norm: torch.Tensor | float = float("nan")
    skipped: bool = False

    def resolve(self) -> "StepResult":
        """Floats instead of tensors, with a single device-to-host copy."""
        names = list(self.aux)
        values = torch.stack([torch.as_tensor(x, dtype=torch.float64, device=self.loss.device)
                              for x in [self.loss, self.grad_norm, *self.aux.values()]]).tolist()
        self.loss, self.grad_norm = values[0], values[1]
        self.aux = dict(zip(names, values[2:]))
        return self


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss or gradient; the message says where."""


def build_datasets(cfg: Config) -> dict:
    if cfg.data.source == "synthetic":
        return synthetic_datasets(cfg.model, cfg.train.seed, cfg.data.mask_prob)
    from ptdp.data import build_datasets as build_indexed
    return build_indexed(cfg)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.grid, self.device = init_distributed(cfg)
        seed_everything(cfg.train.seed, self.grid.pp_rank)
        self._build_model()
        self._build_optimizer()
        self._build_pipeline()
        self._build_data()
        self.iteration = 0   # iterations done = the next iteration to run (the data position)
        self.last_checkpoint = None   # path of the newest checkpoint this job saved
        if cfg.checkpoint.load:
            from ptdp.checkpoint.load import load_checkpoint
            load_checkpoint(self, cfg.checkpoint.load)
        if self.no_flush is not None:
            self.no_flush.start(self.iteration)

    # Construction ---------------------------------------------------------------------------
    def _build_model(self) -> None:
        cfg, grid, par, tr = self.cfg, self.grid, self.cfg.parallel, self.cfg.train
        self.tp = TensorParallel.from_grid(grid, par.sequence_parallel)
        self.ctx = ModelContext(cfg.model, self.tp, tr.seed,
                                TensorParallelRNG(tr.seed, grid.tp_rank, self.device),
                                cfg.padded_vocab_size, tr.recompute, tr.recompute_num_layers,
                                compile=should_compile(tr.compile, self.device),
                                split_backward=schedule_spec(cfg.schedule.name).split_backward)
        WEIGHT_GRADS.clear()   # nothing deferred survives a previous trainer in this process
        self.dtype = PRECISIONS[tr.precision]
        self.stages = rank_stages(grid.pp_rank, par.pipeline, par.chunks)
        num_stages = par.pipeline * par.chunks
        self.chunks = {s: build_chunk(self.ctx, s, num_stages).to(self.device, self.dtype)
                       for s in self.stages}
        self.params = [p for c in self.chunks.values() for p in c.parameters()]

    def _build_optimizer(self) -> None:
        tr, grid = self.cfg.train, self.grid
        self.m = self.cfg.num_micro_batches
        no_flush = not schedule_spec(self.cfg.schedule.name).flushing
        # Master weights first: their fp32-accumulation hook must run before the data-parallel
        # one. Weight versions point parameters at tensors of their own, and 2BW holds one
        # batch's gradients while the next accumulates: one storage per tensor, not flat buffers.
        if tr.distributed_optimizer:   # (config refuses it with the no-flush schedules)
            self.weights = ShardedMasterWeights(self.params, tr.precision, grid.data_group,
                                                grid.dp_rank, grid.d, tr.grad_bucket_mb)
        else:
            self.weights = MasterWeights(self.params, tr.precision,
                                         contiguous=False if no_flush else None)
        self.master_params = self.weights.masters
        if no_flush:  # fp32: the optimizer must not step the parameter objects autograd saved
            self.master_params = aliasing_masters(self.params, self.master_params)
        self.optimizer = build_optimizer(self.master_params, tr)
        self.loss_scaler = LossScaler(dynamic=tr.precision == "fp16", initial=tr.initial_loss_scale)
        # pipedream updates after every input: each parameter accumulates once per reduction
        accumulations = 1 if schedule_spec(self.cfg.schedule.name).update_per_input else self.m
        self.dp_grads = DataParallelGradients(
            self.params, grid.data_group, grid.d, accumulations, tr.grad_bucket_mb,
            flat=self.weights.flat_grads, sharded=self.weights if self.weights.sharded else None)
        self.versions = None     # weight versions (set by the no-flush schedules)
        self.no_flush = None
        if no_flush:
            from ptdp.training import no_flush as no_flush_training
            self.no_flush = no_flush_training.build(self)

    def _build_pipeline(self) -> None:
        cfg, grid, par, tr = self.cfg, self.grid, self.cfg.parallel, self.cfg.train
        self.p2p = P2P(grid.pipeline_ranks, group=grid.pipeline_group,
                       tensor_group=grid.tensor_group, tp_rank=grid.tp_rank, tp_size=grid.t,
                       scatter_gather=par.scatter_gather)
        # with sequence parallelism each tensor rank holds (and sends) its 1/t of the sequence
        seq = cfg.model.seq_length // (grid.t if self.tp.sequence_parallel else 1)
        activation_shape = (seq, tr.micro_batch_size, cfg.model.hidden_size)
        self.executor = PipelineExecutor(
            self.chunks, par.pipeline * par.chunks, self.p2p, activation_shape=activation_shape,
            activation_dtype=self.dtype, device=self.device, versions=self.versions)
        self.wire_shape = self.p2p.wire_shape(activation_shape)
        forwards = [[a for a in row if a.kind == FORWARD]
                    for row in build_all(FORWARD_ONLY.name, par.pipeline, par.chunks, self.m)]
        self.eval_steps = self._plan(forwards)
        self.steps = None  # the no-flush schedules plan a stream of iterations (ptdp.no_flush)
        if self.no_flush is None:
            self.steps = self._plan(build_all(cfg.schedule.name, par.pipeline, par.chunks, self.m))
        if grid.p > 1:  # NCCL: a group's first operation must involve all of its ranks, which
            # a batch of point-to-point operations does not (see dist.batch_isend_irecv)
            dist.all_reduce(torch.zeros(1, device=self.device), group=grid.pipeline_group)

    def _plan(self, schedule) -> list:
        """This rank's steps, after checking every rank's exchanges under NCCL's rules."""
        par, wire = self.cfg.parallel, self.wire_shape
        plans = plan_exchanges(schedule, par.pipeline, par.chunks, lambda message: wire)
        check_plans(plans)
        return plans[self.grid.pp_rank]

    def _build_data(self) -> None:
        tr, grid = self.cfg.train, self.grid
        self.batches = {split: MicroBatches(ds, global_batch=tr.global_batch_size,
                                            micro_batch_size=tr.micro_batch_size,
                                            data_rank=grid.dp_rank, data_size=grid.d,
                                            device=self.device)
                        for split, ds in build_datasets(self.cfg).items() if len(ds) > 0}

    # One iteration, in three steps the tests can call separately ---------------------------
    def forward_backward(self, iteration: int, spans=NO_SPANS) -> StepResult:
        """Every micro-batch's forward and backward; `spans` records their times."""
        self._flushing_only("forward_backward")
        self.weights.zero_grads()
        for chunk in self.chunks.values():
            chunk.train()
        self.dp_grads.start_iteration()
        batches = self.batches["train"]
        result = self.executor.run(
            self.steps, lambda mb: batches.get(iteration, mb),
            loss_scale=self.loss_scaler.scale / (self.m * self.grid.d), spans=spans)
        loss, aux = self._average_loss(result.losses, result.aux)
        return StepResult(loss, aux)

    def reduce_gradients(self, spans=NO_SPANS) -> torch.Tensor:
        """Data-parallel and tied-embedding sums, loss-scale removal; returns the global norm
        (a device tensor: nothing here waits for the device)."""
        self._flushing_only("reduce_gradients")
        with spans("data-parallel reduce", "reduce"):
            self.dp_grads.finish()
            self.weights.grads_to_masters()
        grid, sharded = self.grid, self.weights.sharded
        with spans("embedding reduce + norm", "reduce"):
            if sharded:
                self.weights.sync_shared_embeddings(grid.embedding_group, len(grid.embedding_ranks))
            else:
                sync_shared_embeddings(self.master_params, grid.embedding_group,
                                       len(grid.embedding_ranks))
            if self.tp.sequence_parallel:
                reduce_sequence_parallel_grads(self.master_params, grid.tensor_group, grid.t)
            grads = [m.grad for m in self.master_params if m.grad is not None]
            if self.loss_scaler.scale != 1.0 and grads:
                torch._foreach_div_(grads, self.loss_scaler.scale)
            return global_grad_norm(self.master_params, grid.model_group, grid.tp_rank,
                                    data_group=grid.data_group if sharded else None)

    def optimizer_step(self, iteration: int, grad_norm: torch.Tensor, spans=NO_SPANS) -> bool:
        """Clip and step; returns True if the step was skipped (fp16 overflow).

        Only fp16 reads the norm on the host (to decide the skip); otherwise clipping uses it
        on the device and a non-finite norm is caught once per iteration by `train_step`.
        """
        self._flushing_only("optimizer_step")
        if self.loss_scaler.dynamic and self.loss_scaler.update(float(grad_norm)):
            return True
        with spans("optimizer step", "optimizer"):
            clip_gradients(self.master_params, self.cfg.train.clip_grad, grad_norm)
            lr = learning_rate(iteration, self.cfg.train)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.weights.masters_to_model()
        return False

    def _flushing_only(self, what: str) -> None:
        if self.no_flush is not None:
            raise RuntimeError(f"schedule {self.cfg.schedule.name} runs whole iterations: call "
                               f"train_step, not {what}")

    def train_step(self, iteration: int, spans=NO_SPANS) -> StepResult:
        """One iteration; reads its statistics from the device once, at the end."""
        if self.no_flush is not None:
            step = self.no_flush.train_step(iteration, spans)
        else:
            step = self.forward_backward(iteration, spans)
            step.grad_norm = self.reduce_gradients(spans)
            step.skipped = self.optimizer_step(iteration, step.grad_norm, spans)
        step.resolve()
        self._check_finite(iteration, step)
        return step

    def _check_finite(self, iteration: int, step: StepResult) -> None:
        """Stop on a non-finite loss or gradient (fp32/bf16), or when fp16 keeps overflowing
        at the smallest loss scale: never train on, never checkpoint, diverged weights."""
        if self.loss_scaler.dynamic:
            if not self.loss_scaler.given_up(self.cfg.train.fp16_max_skips):
                return
            what = (f"fp16 overflowed on {self.loss_scaler.skips_at_min_scale} consecutive steps "
                    f"at the minimum loss scale {self.loss_scaler.min_scale:g}")
        elif math.isfinite(step.loss) and math.isfinite(step.grad_norm):
            return
        else:
            what = f"loss {step.loss}, gradient norm {step.grad_norm}"
        # Every rank saw the same reduced loss and norm, so all of them get here together.
        first = next((name for name, master in self._named_masters()
                      if master.grad is not None and not torch.isfinite(master.grad).all()), None)
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, (first, str(self.grid.coords)))
        where = next((f"first non-finite gradient: {name} on rank {rank} {coords}"
                      for rank, (name, coords) in enumerate(found) if name), "")
        raise DivergenceError(f"iteration {iteration + 1}: {what}" + (f"; {where}" if where else "")
                              + "; stopping (no checkpoint written). Lower train.lr or check the data.")

    @torch.no_grad()
    def evaluate(self, round_index: int) -> float:
        """Mean loss over train.eval_iters global batches of the validation split."""
        if "valid" not in self.batches:
            return float("nan")
        if self.versions is not None:   # validate the newest weights
            self.versions.activate_newest()
        for chunk in self.chunks.values():
            chunk.eval()
        batches = self.batches["valid"]
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for k in range(self.cfg.train.eval_iters):
            it = round_index * self.cfg.train.eval_iters + k
            result = self.executor.run(self.eval_steps, lambda mb: batches.get(it, mb),
                                       loss_scale=1.0, forward_only=True)
            total += self._average_loss(result.losses, result.aux)[0]
        return total.item() / self.cfg.train.eval_iters

    def _average_loss(self, losses, aux) -> tuple[torch.Tensor, dict]:
        """Mean over micro-batches and data ranks, known on every rank afterwards (on device)."""
        names = ["lm_loss", "sop_loss"] if self.cfg.model.arch == "bert" else ["lm_loss"]
        values = torch.zeros(1 + len(names), dtype=torch.float64, device=self.device)
        if losses:
            stacked = torch.stack([torch.stack([loss, *(extra[n] for n in names)]).double()
                                   for loss, extra in zip(losses, aux)])
            values += stacked.sum(0)
        for group, size in ((self.grid.pipeline_group, self.grid.p), (self.grid.data_group, self.grid.d)):
            if size > 1:  # only the last stage holds losses; the others add zeros
                dist.all_reduce(values, group=group)
        values /= self.m * self.grid.d
        return values[0], {n: values[1 + i] for i, n in enumerate(names)}

    # The loop ----------------------------------------------------------------------------------
    def train(self, resume_command: str | None = None) -> list[dict]:
        """Run iterations self.iteration .. train.iters; returns their records.

        `resume_command`: the command that would resume this job from its checkpoint.dir,
        printed in the end summary (`ptdp train` builds it from its own command line).
        """
        cfg = self.cfg
        started = time.perf_counter()
        rank0 = self.grid.rank == 0
        log = MetricsLog(cfg, is_writer=rank0)
        if rank0:
            write_config(cfg)
        log.print(startup_report(cfg, self.grid, self.local_parameter_count(),
                                 self.total_parameter_count(), self.device))
        self.last_checkpoint = None
        peak = peak_tflops(cfg, self.device)
        par = cfg.parallel
        tracer = TraceRecorder(cfg.log.trace_file, self.grid.rank, self.grid.coords, self.device,
                               first_iteration=self.iteration + 1,
                               layout={"p": par.pipeline, "t": par.tensor, "d": par.data,
                                       "v": par.chunks, "schedule": cfg.schedule.name, "m": self.m})
        watchdog = self._start_watchdog()
        history = []
        try:
            for it in range(self.iteration, cfg.train.iters):
                watchdog.doing(f"iteration {it + 1}", iteration=it + 1)
                start = time.perf_counter()
                spans = tracer.spans_for(it + 1)
                step = self.train_step(it, watchdog.track(spans))
                tracer.add(it + 1, spans)
                record = self._record(it, step, time.perf_counter() - start, peak)
                self.iteration = it + 1
                if cfg.train.eval_interval and self.iteration % cfg.train.eval_interval == 0:
                    watchdog.doing("evaluation")
                    record["valid_loss"] = self.evaluate(self.iteration // cfg.train.eval_interval - 1)
                history.append(record)
                log.log(record)
                if self._checkpoint_due():
                    watchdog.doing("checkpoint save", watch=False)  # as long as the disk takes
                    log.print(self.save_checkpoint())
            watchdog.doing("trace and shutdown", watch=False)
            tracer.write()
            log.print(end_summary(history, cfg, time.perf_counter() - started, self.device,
                                  self.last_checkpoint, resume_command))
        except RuntimeError as err:
            if is_communication_error(err):
                watchdog.lost_peer(err)   # names the ranks that stopped; ends this process
            raise
        finally:
            watchdog.stop()
            log.close()
        return history

    def _start_watchdog(self) -> Watchdog:
        """Heartbeats and the stall check (ptdp.watchdog); inert on a single rank."""
        grid = self.grid
        describe = lambda r: str(coordinates_of(r, grid.p, grid.d, grid.t))  # noqa: E731
        return Watchdog(grid.rank, dist.get_world_size(), describe, self.cfg.train.timeout_s,
                        first_iteration=self.iteration + 1).start()

    def _record(self, it: int, step: StepResult, seconds: float, peak: float | None) -> dict:
        cfg, tr = self.cfg, self.cfg.train
        tflops = iteration_tflops(cfg, seconds, dist.get_world_size())
        record = {"iter": it + 1, "loss": step.loss, "lr": learning_rate(it, tr),
                  "grad_norm": step.grad_norm, "step_time_s": seconds,
                  "tokens_per_s": tr.global_batch_size * cfg.model.seq_length / seconds,
                  "tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None,
                  "loss_scale": self.loss_scaler.scale, "skipped": step.skipped,
                  "mem_gb": peak_memory_gb(self.device)}
        if cfg.model.arch == "bert":
            record.update(step.aux)
        return record

    def _checkpoint_due(self) -> bool:
        ck = self.cfg.checkpoint
        if not ck.dir:
            return False
        interval_hit = ck.save_interval and self.iteration % ck.save_interval == 0
        return bool(interval_hit or self.iteration == self.cfg.train.iters)

    def save_checkpoint(self) -> str:
        """Save to checkpoint.dir; returns the line to log: path, size and time."""
        from ptdp.checkpoint.save import save_checkpoint
        start = time.perf_counter()
        final = save_checkpoint(self, self.cfg.checkpoint.dir)
        self.last_checkpoint = str(final)
        size = sum(f.stat().st_size for f in final.iterdir() if f.is_file()) if self.grid.rank == 0 else 0
        return (f"saved checkpoint {final} ({format_bytes(size)}, {time.perf_counter() - start:.1f} s)")

    # Whole-model views (reports, tests, conversion) -------------------------------------------
    def named_parameters(self):
        for chunk in self.chunks.values():
            yield from named_global_parameters(chunk)

    def _named_masters(self):
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
        if grads and self.weights.sharded:   # each data rank holds the sums of its shard only
            full = dict(zip(map(id, self.params), self.weights.full_grads()))
            return gather_full_state(self.named_parameters(), self.tp, self.cfg.model.vocab_size,
                                     value_of=lambda p: full[id(p)])
        if grads:
            pairs = [(name, master) for (name, _), master
                     in zip(self.named_parameters(), self.master_params)]
            return gather_full_state(pairs, self.tp, self.cfg.model.vocab_size, grads=True)
        return gather_full_state(self.named_parameters(), self.tp, self.cfg.model.vocab_size)

    def local_parameter_count(self) -> int:
        return sum(p.numel() for p in self.params if not getattr(p, "duplicate", False))

    def total_parameter_count(self) -> int:
        """Whole-model parameters (padded vocabulary included), each weight counted once."""
        local = sum(p.numel() for p in self.params if counts_in_norm(p, self.grid.tp_rank))
        total = torch.tensor(local, dtype=torch.float64, device=self.device)
        if self.grid.model_group is not None and len(self.grid.model_ranks) > 1:
            dist.all_reduce(total, group=self.grid.model_group)
        return int(total.item())

