"""The distributed optimizer (ZeRO stage 1): fp32 master weights and Adam moments sharded
over the parameters' reduce group (their role's `reduce_axes`, ptdp/parallel/roles.py: data x
context for a dense model), called the data group below.

Every data rank holds the same model weights and, after the reduction, would hold the same
summed gradients; each then ran the same AdamW step on the same fp32 state, d times over.
Here each rank keeps the fp32 state of one d-th of the weights only, as in Megatron-LM's
distributed optimizer:

* The model weights and the gradients live in flat buffers (ptdp/optim/buffers.py) laid out
  bucket by bucket, each bucket padded to a multiple of ALIGN * d, so every bucket cuts into
  d equal, aligned, contiguous shards; rank r owns shard r of every bucket.
* Backward is unchanged. Each bucket is reduce-scattered as soon as its gradients are
  complete (ptdp/optim/grads.py), so rank r receives only the sums of its shards.
* The optimizer's parameters are "pieces": 1-D fp32 tensors, one per (parameter, owned
  range) overlap, whose `.grad` are views of the reduced shard. AdamW is elementwise, so
  stepping the pieces is the same arithmetic as stepping the whole tensors. In fp32 the
  pieces are views of the model weights themselves; in bf16/fp16 views of one fp32 buffer
  holding this rank's masters only.
* After the step each bucket's updated shards are all-gathered into the model weights.

Optimizer state per rank drops from 8 (fp32) or 12 (bf16/fp16) bytes per parameter to that
over d; the gradient buffer stays whole (backward accumulates into all of it).

`ShardedMasterWeights` is the sharded kind of the master weights interface
(ptdp/optim/weights.py). Its whole-tensor views (`state_dict`, `optimizer_state_dict`,
`full_grads`) are collective over the data group: each data rank contributes its shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ptdp.optim.buffers import FlatGrads, FlatLayout, bucket_indices
from ptdp.optim.mixed_precision import _add_to_main_grad, _master_copy
from ptdp.optim.optimizer import optimizer_moment_bytes
from ptdp.optim.weights import MOMENTS, has_moments, load_optimizer_states
from ptdp.parallel.mappings import all_gather_single
from ptdp.parallel.roles import reduce_sets, role_of


def shard_group(params: list[nn.Parameter], grid) -> tuple[object, int, int]:
    """(group, this rank's index in it, its size) to shard `params` over: the group their
    gradients are summed over (their role's `reduce_axes`), which must be one for all."""
    sets = list(reduce_sets(params))
    if len(sets) > 1:
        raise ValueError(f"the distributed optimizer shards over one reduce group, but the "
                         f"parameters are reduced over {sets}")
    axes = sets[0]
    return grid.group(*axes), grid.index(*axes), grid.size(*axes)


@dataclass
class ShardedBucket:
    params: list[nn.Parameter]
    span: tuple[int, int]      # [start, end) in the flat buffers
    own: tuple[int, int]       # this rank's shard of it
    shard_offset: int          # where `own` starts in this rank's master shard
    all_reduce: bool           # its gradient must be whole on every rank (tied embedding)
    grads: torch.Tensor        # the bucket's slice of the gradient buffer
    own_grads: torch.Tensor    # this rank's shard of `grads`


class ShardedMasterWeights:
    """The master weights interface (ptdp/optim/weights.py) with the masters sharded."""

    def __init__(self, params: list[nn.Parameter], precision: str, group, rank: int, size: int,
                 bucket_mb: float):
        assert params, "a rank with no parameters has nothing to shard"
        self.params, self.group, self.rank, self.size = params, group, rank, size
        self.half = precision != "fp32"
        device, dtype = params[0].device, params[0].dtype
        groups = bucket_indices([p.numel() * p.element_size() for p in params], bucket_mb * 2**20,
                                alone=[role_of(p).shared_embedding for p in params])
        self.layout = layout = FlatLayout([p.shape for p in params], buckets=groups,
                                          bucket_shards=size)
        self.model_buffer = layout.allocate(dtype, device)
        with torch.no_grad():
            for p, view in zip(params, layout.views(self.model_buffer)):
                view.copy_(p)
                p.data = view          # same Parameter object, storage now in the buffer
        grads = layout.allocate(torch.float32, device)
        self.flat_grads = FlatGrads(layout, grads, {id(p): i for i, p in enumerate(params)})
        self.buckets = self._buckets(groups, grads)
        self.shard_numel = sum(b.own[1] - b.own[0] for b in self.buckets)
        self.master_shard = None   # bf16/fp16: this rank's fp32 masters, bucket shards in order
        if self.half:
            self.master_shard = torch.cat([self.model_buffer[slice(*b.own)] for b in self.buckets]
                                          ).float()
        self.masters = self._pieces(grads)
        for p, g in zip(params, layout.views(grads)):
            if self.half:
                p.main_grad = g
                p.register_post_accumulate_grad_hook(_add_to_main_grad)
            else:
                p.grad = g

    def _buckets(self, groups: list[list[int]], grads: torch.Tensor) -> list[ShardedBucket]:
        buckets, offset = [], 0
        for group, (start, end) in zip(groups, self.layout.bucket_spans):
            share = (end - start) // self.size
            own = (start + self.rank * share, start + (self.rank + 1) * share)
            params = [self.params[i] for i in group]
            buckets.append(ShardedBucket(
                params, (start, end), own, offset,
                all_reduce=any(role_of(p).shared_embedding for p in params),
                grads=grads[start:end], own_grads=grads[own[0]:own[1]]))
            offset += share
        return buckets

    def _pieces(self, grads: torch.Tensor) -> list[nn.Parameter]:
        """One fp32 1-D master per (parameter, owned range) overlap, its .grad bound once."""
        pieces = []
        for bucket in self.buckets:
            for p in bucket.params:
                i = self.flat_grads.index_of[id(p)]
                lo = max(self.layout.offsets[i], bucket.own[0])
                hi = min(self.layout.offsets[i] + p.numel(), bucket.own[1])
                if lo >= hi:
                    continue
                at = bucket.shard_offset + lo - bucket.own[0]   # position in the master shard
                data = (self.master_shard[at: at + hi - lo] if self.half
                        else self.model_buffer[lo:hi])
                piece = _master_copy(p, data)
                piece.param_index = i
                piece.param_range = (lo - self.layout.offsets[i], hi - self.layout.offsets[i])
                piece.shard_offset = at
                piece.source_ndim = p.ndim    # weight decay follows the whole tensor's shape
                piece.grad = grads[lo:hi]
                pieces.append(piece)
        return pieces

    @property
    def shard_layout(self) -> list["ShardedMasterWeights"]:
        """Its buckets fix the data-parallel reduction's (ptdp/optim/grads.py), each
        reduce-scattered into this rank's shard (one sharded set; ptdp/optim/sharded_sets.py
        gives several)."""
        return [self]

    masters_are_pieces = True   # each data rank holds the gradients of its shard only

    # The iteration ------------------------------------------------------------------------
    def zero_grads(self) -> None:
        self.flat_grads.buffer.zero_()

    def grads_to_masters(self) -> None:
        """Nothing to do: the pieces' .grad are views of the reduced shards."""

    def sync_shared_embeddings(self, group, size: int) -> None:
        """Sum the tied word embedding's gradient between the first and last stage (its
        bucket was all-reduced over the data group, so every rank has it whole)."""
        if size <= 1:
            return
        for i, p in enumerate(self.params):
            if role_of(p).shared_embedding:
                dist.all_reduce(self.layout.view(self.flat_grads.buffer, i), group=group)

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """Updated shards into the model weights, then every bucket all-gathered."""
        if self.half:
            torch._foreach_copy_([self.model_buffer[slice(*b.own)] for b in self.buckets],
                                 [self._shard_of(self.master_shard, b) for b in self.buckets])
        if self.size > 1:
            works = [all_gather_single(self.model_buffer[slice(*b.span)],
                                            self.model_buffer[slice(*b.own)], group=self.group,
                                            async_op=True) for b in self.buckets]
            for work in works:
                work.wait()

    # Whole tensors, for tests and checkpoints (collective over the data group) -------------
    def master_param_indices(self) -> list[int]:
        return [piece.param_index for piece in self.masters]

    def state_dict(self) -> list[torch.Tensor]:
        return self.gather_to_host(lambda piece: piece.detach())

    @torch.no_grad()
    def load_state_dict(self, values: list[torch.Tensor]) -> None:
        """Whole local tensors into the model, their ranges into the pieces."""
        for param, value in zip(self.params, values):
            param.copy_(value.view(param.shape))
        for piece in self.masters:
            piece.copy_(self.range_of(piece, values[piece.param_index]))

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> list[dict]:
        step = self.optimizer_step_count(optimizer)   # collective
        if step is None:
            return [{} for _ in self.params]
        whole = {key: self.gather_to_host(lambda piece, key=key: optimizer.state[piece][key])
                 for key in MOMENTS}
        return [{**{key: whole[key][i] for key in MOMENTS}, "step": step}
                for i in range(len(self.params))]

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                  per_param: list[dict]) -> None:
        """Each piece's range of the whole moments."""
        load_optimizer_states(optimizer, self.states_by_piece(per_param))

    def states_by_piece(self, per_param: list[dict]) -> dict[int, dict]:
        """{id(piece): its step and its range of the saved moments} (pieces with any)."""
        by_piece = {}
        for piece in self.masters:
            saved = per_param[piece.param_index]
            if has_moments(saved):
                by_piece[id(piece)] = {"step": saved["step"].clone(), **{
                    key: self.range_of(piece, saved[key]).clone() for key in MOMENTS}}
        return by_piece

    def gather(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Per parameter, the whole tensor assembled from every rank's `shard` (shaped like
        the master shard: this rank's bucket shards in order)."""
        full = self.layout.allocate(shard.dtype, shard.device)
        for b in self.buckets:
            mine = self._shard_of(shard, b)
            if self.size > 1:
                all_gather_single(full[slice(*b.span)], mine, group=self.group)
            else:
                full[slice(*b.own)].copy_(mine)
        return self.layout.views(full)

    @torch.no_grad()
    def gather_to_host(self, value_of) -> list[torch.Tensor]:
        """Per parameter, its whole fp32 tensor in host memory (a private copy), assembled
        from every rank's `value_of(piece)`, bucket by bucket: a save never holds more than
        one bucket on the device (not the whole fp32 state, three times, as a `gather` per
        value would) and pins no host memory. Collective over the data group.

        A rank whose own part fails (its values, the device bucket, the host copy) must not
        leave the others waiting in the next bucket's all-gather: before each all-gather, and
        once after the last, the ranks agree whether any failed (`_agree`), so every rank
        issues the same collectives and all stop at the same point with an error."""
        out: list = [None] * len(self.params)
        pieces = {}
        for piece in self.masters:
            pieces.setdefault(self.layout.offsets[piece.param_index], []).append(piece)
        failed = None   # this rank's first error
        for index, b in enumerate(self.buckets):
            if failed is None:
                try:
                    full, mine = self._bucket_values(b, pieces, value_of)
                except Exception as err:   # noqa: BLE001 - every rank must hear of it
                    failed = err
            self._agree(failed, index)
            if self.size > 1:
                all_gather_single(full, mine, group=self.group)   # in place, as NCCL allows
            try:
                for p in b.params:
                    i = self.flat_grads.index_of[id(p)]
                    lo = self.layout.offsets[i] - b.span[0]
                    out[i] = full[lo: lo + p.numel()].view(p.shape).to("cpu", copy=True)
            except Exception as err:   # noqa: BLE001 - told at the next agreement
                failed = err
            del full, mine
        self._agree(failed, len(self.buckets))
        return out

    def _bucket_values(self, b: ShardedBucket, pieces: dict, value_of):
        """Bucket `b` on the device, fp32, with this rank's values in its own shard `mine`."""
        start, end = b.span
        full = torch.zeros(end - start, dtype=torch.float32, device=self.model_buffer.device)
        mine = full[b.own[0] - start: b.own[1] - start]
        for p in b.params:
            i = self.flat_grads.index_of[id(p)]
            for piece in pieces.get(self.layout.offsets[i], []):
                at = piece.shard_offset - b.shard_offset
                mine[at: at + piece.numel()].copy_(value_of(piece))
        return full, mine

    def _agree(self, error: Exception | None, bucket: int) -> None:
        """Raise on every rank of the data group if any rank's `error` is set: the rank that
        failed its own error, the others one line naming it. Collective (one small
        all-reduce, and a host read: a save's, never the step loop's)."""
        if self.size > 1:
            failed = torch.zeros(self.size, dtype=torch.int32, device=self.model_buffer.device)
            failed[self.rank] = error is not None
            dist.all_reduce(failed, group=self.group)
            ranks = failed.nonzero().flatten().tolist()
        else:
            ranks = [self.rank] if error is not None else []
        if error is not None:
            raise error
        if ranks:
            where = (f"before bucket {bucket} of {len(self.buckets)}"
                     if bucket < len(self.buckets) else "after its last bucket")
            group = dist.group.WORLD if self.group is None else self.group
            ranks = [dist.get_global_rank(group, r) for r in ranks]
            raise RuntimeError(f"distributed-optimizer save stopped {where}: rank(s) {ranks} "
                               f"of its data group failed (their own error says why)")

    def full_grads(self) -> list[torch.Tensor]:
        """The reduced gradients of whole parameters (after `reduce_gradients`)."""
        shard = torch.cat([b.own_grads for b in self.buckets])
        full = self.gather(shard)
        for b in self.buckets:   # all-reduced buckets are whole already (and embedding-synced)
            if b.all_reduce:
                for p in b.params:
                    i = self.flat_grads.index_of[id(p)]
                    full[i] = self.layout.view(self.flat_grads.buffer, i).clone()
        return full

    @staticmethod
    def range_of(piece, whole: torch.Tensor) -> torch.Tensor:
        """`piece`'s elements of its parameter's whole tensor `whole` (a flat view)."""
        return whole.reshape(-1)[slice(*piece.param_range)]

    def optimizer_step_count(self, optimizer) -> torch.Tensor | None:
        """The optimizer's step as a CPU float tensor, None before the first step. Collective
        over the data group: a rank may own no piece at all in a tiny model."""
        step = torch.zeros((), dtype=torch.float64, device=self.model_buffer.device)
        for piece in self.masters:
            if "step" in optimizer.state.get(piece, {}):
                step.fill_(float(optimizer.state[piece]["step"]))
                break
        if self.size > 1:
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=self.group)
        return step.float().cpu() if step.item() > 0 else None

    def _shard_of(self, shard: torch.Tensor, bucket: ShardedBucket) -> torch.Tensor:
        return shard[bucket.shard_offset: bucket.shard_offset + bucket.own[1] - bucket.own[0]]

    def state_bytes(self, optimizer) -> int:
        """Bytes of fp32 state this rank keeps for the optimizer: masters held apart from the
        model weights, and Adam's moments (what the distributed optimizer divides by d)."""
        masters = self.master_shard.numel() * 4 if self.half else 0
        return masters + optimizer_moment_bytes(optimizer)
