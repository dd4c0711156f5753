"""The training loop: build the rank's model chunks, run the schedule, reduce, step, log.

One iteration = one global batch: the executor runs this rank's action list (forwards and
backwards of every micro-batch), gradients are summed over the data group (overlapped with
the last backward) and between the tied embedding copies, clipped by the global norm, and
AdamW steps. Every rank builds the same objects for its coordinates; nothing is global.
"""

from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from models import ModelContext, build_chunk, named_global_parameters
from ptdp.batching import MicroBatches
from ptdp.config import Config
from ptdp.data.synthetic import synthetic_datasets
from ptdp.optim.grads import (DataParallelGradients, clip_gradients, global_grad_norm,
                              sync_shared_embeddings)
from ptdp.optim.loss_scale import LossScaler
from ptdp.optim.lr import learning_rate
from ptdp.optim.optimizer import build_optimizer
from ptdp.parallel.tensor import TensorParallel, TensorParallelRNG, seed_everything
from ptdp.pipeline.executor import PipelineExecutor, StageLayout
from ptdp.pipeline.p2p import P2P
from ptdp.pipeline.schedules import build_schedule, rank_stages
from ptdp.planner.formulas import model_flops_per_iteration
from ptdp.runtime import init_distributed
from ptdp.sharding import gather_full_state


@dataclass
class StepResult:
    loss: float
    aux: dict
    grad_norm: float


def build_datasets(cfg: Config) -> dict:
    if cfg.data.source == "synthetic":
        return synthetic_datasets(cfg.model, cfg.train.seed, cfg.data.mask_prob)
    from ptdp.data import build_datasets as build_indexed  # needs the data extras
    return build_indexed(cfg)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.grid, self.device = init_distributed(cfg)
        grid, par, tr = self.grid, cfg.parallel, cfg.train
        seed_everything(tr.seed, grid.pp_rank)
        self.tp = TensorParallel.from_grid(grid)
        self.ctx = ModelContext(cfg.model, self.tp, tr.seed,
                                TensorParallelRNG(tr.seed, grid.tp_rank, self.device),
                                cfg.padded_vocab_size, tr.recompute, tr.recompute_num_layers)
        self.m = cfg.num_micro_batches
        self.stages = rank_stages(grid.pp_rank, par.pipeline, par.chunks)
        num_stages = par.pipeline * par.chunks
        self.chunks = {s: build_chunk(self.ctx, s, num_stages).to(self.device) for s in self.stages}
        self.params = [p for c in self.chunks.values() for p in c.parameters()]
        # The optimizer updates fp32 master weights; in fp32 training they are the model's own.
        self.master_params = self.params
        self.optimizer = build_optimizer(self.master_params, tr)
        self.loss_scaler = LossScaler(dynamic=tr.precision == "fp16", initial=tr.initial_loss_scale)
        self.dp_grads = DataParallelGradients(self.params, grid.data_group, grid.d, self.m,
                                              tr.grad_bucket_mb)
        self.p2p = P2P(tensor_group=grid.tensor_group, tp_rank=grid.tp_rank, tp_size=grid.t,
                       scatter_gather=par.scatter_gather)
        self.executor = PipelineExecutor(
            self.chunks, StageLayout(par.pipeline, par.chunks, grid.pipeline_ranks), self.p2p,
            activation_shape=(cfg.model.seq_length, tr.micro_batch_size, cfg.model.hidden_size),
            activation_dtype=torch.float32, device=self.device)
        self.actions = build_schedule(cfg.schedule.name, par.pipeline, par.chunks, self.m,
                                      grid.pp_rank)
        datasets = build_datasets(cfg)
        self.batches = {split: MicroBatches(ds, global_batch=tr.global_batch_size,
                                            micro_batch_size=tr.micro_batch_size,
                                            data_rank=grid.dp_rank, data_size=grid.d,
                                            device=self.device)
                        for split, ds in datasets.items()}
        self.iteration = 0   # iterations done = the next iteration to run (the data position)
        if cfg.checkpoint.load:
            from ptdp.checkpoint import load_checkpoint
            load_checkpoint(self, cfg.checkpoint.load)

    # One iteration, in three steps the tests can call separately ---------------------------
    def forward_backward(self, iteration: int) -> StepResult:
        for p in self.params:
            p.grad = None
        for chunk in self.chunks.values():
            chunk.train()
        self.dp_grads.start_iteration()
        batches = self.batches["train"]
        result = self.executor.run(self.actions, lambda mb: batches.get(iteration, mb),
                                   loss_scale=1.0 / (self.m * self.grid.d))
        loss, aux = self._average_loss(result.losses, result.aux)
        return StepResult(loss, aux, grad_norm=float("nan"))

    def reduce_gradients(self) -> float:
        """Data-parallel sum, tied-embedding sum; returns the global gradient norm."""
        self.dp_grads.finish()
        sync_shared_embeddings(self.params, self.grid.embedding_group, len(self.grid.embedding_ranks))
        return global_grad_norm(self.params, self.grid.model_group, self.grid.tp_rank)

    def optimizer_step(self, iteration: int, grad_norm: float) -> None:
        clip_gradients(self.params, self.cfg.train.clip_grad, grad_norm)
        lr = learning_rate(iteration, self.cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def train_step(self, iteration: int) -> StepResult:
        step = self.forward_backward(iteration)
        step.grad_norm = self.reduce_gradients()
        self.optimizer_step(iteration, step.grad_norm)
        return step

    def _average_loss(self, losses, aux) -> tuple[float, dict]:
        """Mean over micro-batches and data ranks, known on every rank afterwards."""
        names = sorted(aux[0]) if aux else self._aux_names()
        values = torch.zeros(1 + len(names), dtype=torch.float64, device=self.device)
        for loss, extra in zip(losses, aux):
            values[0] += loss.double()
            for i, name in enumerate(names):
                values[1 + i] += extra[name].double()
        for group, size in ((self.grid.pipeline_group, self.grid.p), (self.grid.data_group, self.grid.d)):
            if size > 1:  # only the last stage holds losses; others add zeros
                dist.all_reduce(values, group=group)
        values /= self.m * self.grid.d
        return values[0].item(), {n: values[1 + i].item() for i, n in enumerate(names)}

    def _aux_names(self) -> list[str]:
        return ["lm_loss", "sop_loss"] if self.cfg.model.arch == "bert" else ["lm_loss"]

    # The loop ----------------------------------------------------------------------------------
    def train(self) -> list[dict]:
        cfg = self.cfg
        metrics_out = open(cfg.log.metrics_file, "a") if cfg.log.metrics_file and self.grid.rank == 0 else None
        history = []
        try:
            for it in range(self.iteration, cfg.train.iters):
                start = time.perf_counter()
                step = self.train_step(it)
                record = self._metrics(it, step, time.perf_counter() - start)
                history.append(record)
                if metrics_out:
                    metrics_out.write(json.dumps(record) + "\n")
                    metrics_out.flush()
                if self.grid.rank == 0 and (it + 1) % cfg.log.interval == 0:
                    print(f"iter {it + 1:>5}/{cfg.train.iters} loss {step.loss:.4f} "
                          f"lr {record['lr']:.2e} grad_norm {step.grad_norm:.3f} "
                          f"{record['tokens_per_s']:.0f} tok/s", flush=True)
                self.iteration = it + 1
                if self._checkpoint_due():
                    self.save_checkpoint()
        finally:
            if metrics_out:
                metrics_out.close()
        return history

    def _checkpoint_due(self) -> bool:
        ck = self.cfg.checkpoint
        if not ck.dir:
            return False
        interval_hit = ck.save_interval and self.iteration % ck.save_interval == 0
        return bool(interval_hit or self.iteration == self.cfg.train.iters)

    def save_checkpoint(self) -> None:
        from ptdp.checkpoint import save_checkpoint
        save_checkpoint(self, self.cfg.checkpoint.dir)

    def _metrics(self, it: int, step: StepResult, seconds: float) -> dict:
        cfg, tr = self.cfg, self.cfg.train
        flops = model_flops_per_iteration(tr.global_batch_size, cfg.model.seq_length,
                                          cfg.model.num_layers, cfg.model.hidden_size,
                                          cfg.padded_vocab_size,
                                          recompute_forward=tr.recompute == "full")
        world = dist.get_world_size()
        record = {"iter": it + 1, "loss": step.loss, "lr": learning_rate(it, tr),
                  "grad_norm": step.grad_norm, "step_time_s": seconds,
                  "tokens_per_s": tr.global_batch_size * cfg.model.seq_length / seconds,
                  "tflops_per_gpu": flops / seconds / world / 1e12, "mfu": None,
                  "loss_scale": 1.0, "skipped": False, "mem_gb": peak_memory_gb(self.device)}
        if cfg.model.arch == "bert":
            record.update(step.aux)
        return record

    # Whole-model views (tests, conversion) ----------------------------------------------------
    def named_parameters(self):
        for chunk in self.chunks.values():
            yield from named_global_parameters(chunk)

    def full_state(self, grads: bool = False) -> dict:
        return gather_full_state(self.named_parameters(), self.tp, self.cfg.model.vocab_size, grads)


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
