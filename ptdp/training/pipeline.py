"""This rank's part of the pipeline as the trainer runs it: the point-to-point transport, the
executor over the rank's chunks, and the plans (a schedule's actions with their exchanges,
checked under NCCL's rules for every rank before anything runs)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ptdp.config.catalogue import FORWARD_ONLY, schedule_spec
from ptdp.models.moe import moe_aux_loss_names
from ptdp.models.mtp import mtp_aux_loss_names
from ptdp.pipeline.actions import FORWARD
from ptdp.pipeline.comm_plan import Message, check_plans, plan_exchanges
from ptdp.pipeline.executor import PipelineExecutor
from ptdp.pipeline.p2p import P2P
from ptdp.pipeline.schedules import build_all
from ptdp.pipeline.window import NoFlushPlan
from ptdp.training.state import TrainingState


class Pipeline:
    def __init__(self, state: TrainingState):
        cfg, grid, par = state.cfg, state.grid, state.cfg.parallel
        self.state, self.p, self.v = state, par.pipeline, par.chunks
        self.p2p = P2P(grid.ranks("pipeline"), group=grid.group("pipeline"),
                       tensor_group=grid.group("tensor"), tp_rank=grid.tp_rank, tp_size=grid.t,
                       scatter_gather=par.scatter_gather)
        # What crosses a stage boundary (the executor's chunk contract): every model family
        # hands on one [s, b, h] hidden state. Side outputs: the aux losses of MoE layers
        # (models/moe.py) and of the multi-token-prediction depths (models/mtp.py), declared
        # here from the config, so that every rank derives the same.
        # With sequence parallelism each tensor rank holds (and sends) its 1/t of the sequence,
        # with context parallelism each context rank its 2 of 2c chunks.
        boundary = ((cfg.local_seq_length, cfg.train.micro_batch_size, cfg.model.hidden_size),)
        self.executor = PipelineExecutor(state.chunks, self.p * self.v, self.p2p,
                                         boundary_shapes=lambda stage: boundary,
                                         activation_dtype=state.dtype, device=state.device,
                                         aux_loss_names=moe_aux_loss_names(cfg.model)
                                         + mtp_aux_loss_names(cfg.model))
        # each boundary tensor's shape on the wire (1/t of it with scatter/gather)
        self.wire_shapes = tuple(self.p2p.wire_shape(shape) for shape in boundary)
        # Validation runs the forwards of a forward-only schedule, nothing to backward.
        forwards = [[a for a in row if a.kind == FORWARD]
                    for row in build_all(FORWARD_ONLY.name, self.p, self.v, state.m)]
        self.eval_steps = self.plan(forwards)
        if grid.p > 1:  # NCCL: a group's first operation must involve all of its ranks, which
            # a batch of point-to-point operations does not (see dist.batch_isend_irecv)
            dist.all_reduce(torch.zeros(1, device=state.device), group=grid.group("pipeline"))
        if grid.c > 1:  # the same for the context ring's batches (every member is in each)
            dist.all_reduce(torch.zeros(1, device=state.device), group=grid.group("context"))

    def plan(self, schedule: list) -> list:
        """This rank's steps of `schedule` (every rank's action lists), after checking every
        rank's exchanges under NCCL's rules."""
        plans = plan_exchanges(schedule, self.p, self.v, self._wire_shape, self.executor.tensors,
                               placement=schedule_spec(self.state.cfg.schedule.name).placement)
        check_plans(plans)
        return plans[self.state.grid.pp_rank]

    def no_flush_plan(self, name: str, first: int, iterations: int) -> NoFlushPlan:
        """Every rank's steps for iterations first .. first+iterations-1 of a no-flush run."""
        return NoFlushPlan(name, self.p, self.v, self.state.m, first=first,
                           iterations=iterations, shape_of=self._wire_shape,
                           tensors=self.executor.tensors)

    def _wire_shape(self, message: Message) -> tuple:
        return self.wire_shapes[message.index]
