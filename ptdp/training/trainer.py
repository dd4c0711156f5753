"""The trainer: build this rank's part of the job, then run iterations, validate, log and save.

Construction (`Trainer.__init__`), in order: the process group and rank grid; the training
state (ptdp/training/state.py: model chunks, master weights, optimizer, loss scaler, gradient
reduction, random streams); the pipeline (ptdp/training/pipeline.py: transport, executor,
plans); the data; and the step of the schedule's family, chosen once here (`STEP_TYPES`):
flushing (ptdp/training/flushing.py), PipeDream-2BW (two_bw.py) or PipeDream async
(pipedream.py). A checkpoint, if one is to be loaded, goes into the state last.

The loop (`Trainer.train`) reads top to bottom: one `train_step` per iteration (statistics read
from the device once, at the end), a check that the run has not diverged, the metrics record,
validation and checkpoints between iterations. The hang detector (ptdp/runtime/watchdog.py)
watches every rank throughout.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ptdp.checkpoint.background import BackgroundSaves
from ptdp.checkpoint.layout import resolve_load
from ptdp.checkpoint.load import load_checkpoint
from ptdp.checkpoint.safety import check_shared_directory
from ptdp.checkpoint.save import save_checkpoint
from ptdp.config import Config
from ptdp.config.catalogue import Family, schedule_spec
from ptdp.data.batching import MicroBatches
from ptdp.data.loader import micro_batch_source
from ptdp.data.synthetic import synthetic_datasets
from ptdp.metrics.log import MetricsLog, aux_loss_fields, write_config
from ptdp.metrics.report import (SaveTiming, end_summary, expert_load_summary, format_bytes,
                                 startup_report)
from ptdp.metrics.throughput import iteration_tflops, peak_memory_gb, peak_tflops
from ptdp.optim.lr import learning_rate
from ptdp.parallel.grid import coordinates_of
from ptdp.runtime.exit_status import restart_attempt
from ptdp.runtime.startup import init_distributed
from ptdp.runtime.progress import DeviceProgress, device_events
from ptdp.runtime.trace import NO_SPANS, TraceRecorder
from ptdp.runtime.watchdog import Watchdog, is_communication_error
from ptdp.training.flushing import FlushingStep
from ptdp.training.pipedream import PipeDreamStep
from ptdp.training.pipeline import Pipeline
from ptdp.training.results import DivergenceError, StepResult, average_losses
from ptdp.training.state import build_state
from ptdp.training.two_bw import TwoBWStep

STEP_TYPES = {Family.FLUSH: FlushingStep, Family.DOUBLE_BUFFERED: TwoBWStep,
              Family.ASYNC: PipeDreamStep}


def build_datasets(cfg: Config) -> dict:
    if cfg.data.source == "synthetic":
        return synthetic_datasets(cfg.model, cfg.train.seed, cfg.data.mask_prob)
    from ptdp.data import build_datasets as build_indexed
    return build_indexed(cfg)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.spec = schedule_spec(cfg.schedule.name)
        grid, device = init_distributed(cfg)
        if cfg.checkpoint.dir:   # every node must see the same folder: fail now, not at a save
            check_shared_directory(cfg.checkpoint.dir)
        self.state = build_state(cfg, grid, device, self.spec)
        self.pipeline = Pipeline(self.state)
        tr = cfg.train
        # micro-batches built on this thread, or ahead by data.num_workers processes
        # (validation batches are whole: only training ramps its batch up)
        self.batches = {split: micro_batch_source(
            MicroBatches(ds, global_batch=tr.global_batch_size,
                         micro_batch_size=tr.micro_batch_size, data_rank=grid.dp_rank,
                         data_size=grid.d, device=device, context_rank=grid.cp_rank,
                         context_size=grid.c,
                         schedule=self.state.batches if split == "train" else None,
                         prediction_depths=cfg.model.mtp_layers),
            cfg.data.num_workers if split != "test" else 0)
                        for split, ds in build_datasets(cfg).items() if len(ds) > 0}
        self.step = STEP_TYPES[self.spec.family](self.state, self.pipeline, self.batches["train"])
        self.last_checkpoint = None   # path of the newest checkpoint this job saved
        self.saves = BackgroundSaves(device) if cfg.checkpoint.async_save else None
        self.save_timing = SaveTiming()
        load = self._checkpoint_to_load()
        if load:
            self.save_timing.resumed(load_checkpoint(self.state, load))
        self.step.start(self.iteration)

    def _checkpoint_to_load(self) -> str | None:
        """checkpoint.load, `auto`'s newest checkpoint in checkpoint.dir, or a restarted job's
        own newest checkpoint (ptdp/checkpoint/layout.py `resolve_load`). Rank 0 decides and
        says so, so every rank loads the same even while the folder changes."""
        decided = [resolve_load(self.cfg.checkpoint, restart_attempt() > 0)]
        dist.broadcast_object_list(decided, src=0)
        load, which = decided[0]
        if which and self.state.grid.rank == 0:
            print(f"ptdp train: {which}", flush=True)
        return load

    @property
    def iteration(self) -> int:
        """Iterations done = the next iteration to run (the data position)."""
        return self.state.progress.iteration

    # One iteration ----------------------------------------------------------------------------
    def train_step(self, iteration: int, spans=NO_SPANS) -> StepResult:
        """One iteration; reads its statistics from the device once, at the end."""
        step = self.step.train_step(iteration, spans).resolve()
        self._check_finite(iteration, step)
        return step

    def _check_finite(self, iteration: int, step: StepResult) -> None:
        """Stop on a non-finite loss or gradient (fp32/bf16), or when fp16 keeps overflowing
        at the smallest loss scale: never train on, never checkpoint, diverged weights."""
        scaler = self.state.loss_scaler
        if scaler.dynamic:
            if not scaler.given_up(self.cfg.train.fp16_max_skips):
                return
            what = (f"fp16 overflowed on {scaler.skips_at_min_scale} consecutive steps at the "
                    f"minimum loss scale {scaler.min_scale:g}")
        elif math.isfinite(step.loss) and math.isfinite(step.grad_norm):
            return
        else:
            what = f"loss {step.loss}, gradient norm {step.grad_norm}"
        # Every rank saw the same reduced loss and norm, so all of them get here together.
        first = next((name for name, master in self.state.named_masters()
                      if master.grad is not None and not torch.isfinite(master.grad).all()), None)
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, (first, str(self.state.grid.coords)))
        where = next((f"first non-finite gradient: {name} on rank {rank} {coords}"
                      for rank, (name, coords) in enumerate(found) if name), "")
        raise DivergenceError(f"iteration {iteration + 1}: {what}" + (f"; {where}" if where else "")
                              + "; stopping (no checkpoint written). Lower train.lr or check the data.")

    @torch.no_grad()
    def evaluate(self, round_index: int, spans=NO_SPANS) -> float:
        """Mean loss over train.eval_iters global batches of the validation split. `spans`
        sees every action (the hang detector counts them as progress)."""
        if "valid" not in self.batches:
            return float("nan")
        if self.state.versions is not None:   # validate the newest weights
            self.state.versions.activate_newest()
        for chunk in self.state.chunks.values():
            chunk.eval()
        batches, eval_iters = self.batches["valid"], self.cfg.train.eval_iters
        total = torch.zeros((), dtype=torch.float64, device=self.state.device)
        for k in range(eval_iters):
            it = round_index * eval_iters + k
            result = self.pipeline.executor.run(self.pipeline.eval_steps,
                                                lambda mb: batches.get(it, mb),
                                                loss_scale=1.0, spans=spans, forward_only=True)
            total += average_losses(self.state, result).loss
        return total.item() / eval_iters

    # The loop ----------------------------------------------------------------------------------
    def train(self, resume_command: str | None = None) -> list[dict]:
        """Run iterations self.iteration .. train.iters; returns their records.

        `resume_command`: the command that would resume this job from its checkpoint.dir,
        printed in the end summary (`ptdp train` builds it from its own command line).
        """
        cfg, state = self.cfg, self.state
        started = time.perf_counter()
        rank0 = state.grid.rank == 0
        log = MetricsLog(cfg, is_writer=rank0, first_iteration=self.iteration)
        if rank0:
            write_config(cfg)
        log.print(startup_report(cfg, state.grid, state.local_parameter_count(),
                                 state.total_parameter_count(), state.device))
        log.print(self.save_timing.advice(cfg.checkpoint))   # from a resumed job's figures
        self.last_checkpoint = None
        peak = peak_tflops(cfg, state.device)
        tracer = self._tracer()
        watchdog = self._start_watchdog()
        history, evaluated = [], False
        try:
            for it in range(self.iteration, cfg.train.iters):
                watchdog.doing(f"iteration {it + 1}", iteration=it + 1)
                start = time.perf_counter()
                spans = tracer.spans_for(it + 1)
                step = self.train_step(it, watchdog.track(spans))
                tracer.add(it + 1, spans)
                record = self._record(it, step, time.perf_counter() - start, peak)
                state.progress.iteration = it + 1
                if cfg.train.eval_interval and self.iteration % cfg.train.eval_interval == 0:
                    # every validation forward is progress; the first pass compiles its own
                    # graphs (no autograd) and gets the start-up budget
                    watchdog.doing("evaluation", slow=not evaluated)
                    record["valid_loss"] = self.evaluate(
                        self.iteration // cfg.train.eval_interval - 1, watchdog.track(NO_SPANS))
                    evaluated = True
                history.append(record)
                log.log(record)
                self.save_timing.iteration(record["step_time_s"])
                if self.saves is not None and self.saves.in_flight:
                    log.print(self._published(self.saves.poll()))
                if self._checkpoint_due():
                    watchdog.saving(self.iteration, self.save_timing.stall_s)  # + its own time
                    log.print(self.save_checkpoint())
                    log.print(self.save_timing.advice(cfg.checkpoint))
            watchdog.doing("trace and shutdown", watch=False)
            if self.saves is not None:
                log.print(self._published(self.saves.wait()))
            tracer.write()
            log.print(end_summary(history, cfg, time.perf_counter() - started, state.device,
                                  self.last_checkpoint, resume_command))
            if state.experts is not None:
                log.print(expert_load_summary(state.experts.layers, state.experts.total))
        except RuntimeError as err:
            if is_communication_error(err):
                watchdog.lost_peer(err)   # names the ranks that stopped; ends this process
            raise
        finally:
            watchdog.stop()
            log.close()
            for batches in self.batches.values():   # data-loader workers, if any
                getattr(batches, "close", lambda: None)()
        return history

    def _tracer(self) -> TraceRecorder:
        cfg, grid, par = self.cfg, self.state.grid, self.cfg.parallel
        layout = {"p": par.pipeline, "t": par.tensor, "d": par.data, "v": par.chunks,
                  "schedule": cfg.schedule.name,
                  "m": self.state.micro_batches(self.iteration + 1)}   # the first traced one's m
        if par.context > 1:   # only then, as in checkpoints: c = 1 traces read as before
            layout["c"] = par.context
        return TraceRecorder(cfg.log.trace_file, grid.rank, grid.coords, self.state.device,
                             first_iteration=self.iteration + 1, layout=layout)

    def _start_watchdog(self) -> Watchdog:
        """Heartbeats and the stall check (ptdp/runtime/watchdog.py); inert on a single rank."""
        grid = self.state.grid
        describe = lambda r: str(coordinates_of(r, grid.p, grid.d, grid.t, grid.c))  # noqa: E731
        tr = self.cfg.train
        return Watchdog(grid.rank, dist.get_world_size(), describe, tr.timeout_s,
                        startup_timeout_s=tr.startup_timeout_s, first_iteration=self.iteration + 1,
                        progress=DeviceProgress(device_events(self.state.device))).start()

    def _record(self, it: int, step: StepResult, seconds: float, peak: float | None) -> dict:
        """The metrics record of iteration `it` (the public fields: README's metrics table)."""
        cfg, tr, batches = self.cfg, self.cfg.train, self.state.batches
        batch = batches.batch_size(it)
        tflops = iteration_tflops(cfg, seconds, dist.get_world_size(), batch)
        # the rate this iteration's update used (or would have: the skips before it count)
        skipped_before = self.state.progress.skipped_samples - (batch if step.skipped else 0)
        record = {"iter": it + 1, "loss": step.loss,
                  "lr": learning_rate(it, tr, batches, skipped_before),
                  "grad_norm": step.grad_norm, "step_time_s": seconds,
                  "global_batch_size": batch,
                  "tokens_per_s": batch * cfg.model.seq_length / seconds,
                  "tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None,
                  "loss_scale": self.state.loss_scaler.scale, "skipped": step.skipped,
                  "mem_gb": peak_memory_gb(self.state.device)}
        record.update({name: step.aux[name] for name in cfg.model.family.logged_losses})
        record.update(aux_loss_fields(step.aux_losses))   # none: the record is as before
        if self.state.experts is not None:
            record.update(self.state.experts.metrics())
        return record

    def _checkpoint_due(self) -> bool:
        ck = self.cfg.checkpoint
        if not ck.dir:
            return False
        interval_hit = ck.save_interval and self.iteration % ck.save_interval == 0
        return bool(interval_hit or self.iteration == self.cfg.train.iters)

    def save_checkpoint(self) -> str:
        """Save to checkpoint.dir, or with checkpoint.async_save start writing it in the
        background; returns the lines to log: path, size, and how long training stood still."""
        start = time.perf_counter()
        if self.saves is None:
            final = save_checkpoint(self.state, self.cfg.checkpoint.dir,
                                    self.save_timing.metadata())
            stall = self.save_timing.saved(time.perf_counter() - start)
            return self._published(final, f"{stall:.1f} s")
        earlier = self._published(self.saves.start(self.state, self.cfg.checkpoint.dir,
                                                   self.save_timing.metadata()))
        stall = self.save_timing.saved(time.perf_counter() - start)
        return "\n".join(filter(None, [
            earlier, f"checkpoint of iteration {self.iteration}: state copied in {stall:.1f} s, "
                     f"writing in the background"]))

    def _published(self, final, how: str = "written in the background") -> str | None:
        """The line for a checkpoint just published (None: nothing was)."""
        if final is None:
            return None
        self.last_checkpoint = str(final)
        size = (sum(f.stat().st_size for f in final.iterdir() if f.is_file())
                if self.state.grid.rank == 0 else 0)
        return f"saved checkpoint {final} ({format_bytes(size)}, {how})"

    # Whole-model views (reports, tests, conversion) -------------------------------------------
    def named_parameters(self):
        return self.state.named_parameters()

    def full_state(self, grads: bool = False) -> dict:
        """Full fp32 weights (or gradients) by global name, on every rank (collective)."""
        return self.state.full_state(grads)
