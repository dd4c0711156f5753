"""Whole-model views of sharded parameters: gather shards into full tensors, slice them back.

A parameter split over the tensor group has `tp_split_dim` in its role
(ptdp/parallel/roles.py); vocabulary-sized ones are `vocab_padded` (their padding rows depend on t, so full tensors are trimmed to the real
vocabulary). With these two facts any layout's shards convert to and from the layout-free
single-process tensors, which is what the equivalence tests compare and what resharding uses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ptdp.parallel.roles import role_of


# fp32 elements per all-gather of `gather_full_state` (256 MiB): one exchange for a test's
# whole model, a bounded amount of device memory for a large one.
GATHER_BATCH = 1 << 26


def full_tensors(items: list, tp, vocab_size: int) -> list[torch.Tensor]:
    """The full fp32 tensors of `items`, (param, value) pairs where value is the param or its
    grad: the values split over the tensor group are all-gathered, a batch of them per
    collective (each one's flattened shard side by side); vocabulary padding is trimmed.
    Converting to fp32 before the gather is exact, so the result is the same as gathering each."""
    out = [value.detach().to(torch.float32, copy=True) for _, value in items]
    split = [i for i, (param, _) in enumerate(items)
             if role_of(param).tp_split_dim is not None and tp.size > 1]
    for batch in _batches([(i, out[i].numel()) for i in split], GATHER_BATCH):
        flat = torch.cat([out[i].reshape(-1) for i in batch])
        parts = [torch.empty_like(flat) for _ in range(tp.size)]
        dist.all_gather(parts, flat, group=tp.group)
        offset = 0
        for i in batch:
            n, shape = out[i].numel(), out[i].shape
            dim = role_of(items[i][0]).tp_split_dim
            out[i] = torch.cat([part[offset:offset + n].view(shape) for part in parts], dim=dim)
            offset += n
    return [value[:vocab_size] if role_of(param).vocab_padded else value
            for (param, _), value in zip(items, out)]


def _batches(sizes: list[tuple[int, int]], limit: int):
    """Consecutive runs of the (index, size) pairs' indices, each run's sizes summing to at
    most `limit` (a larger one alone)."""
    batch, total = [], 0
    for index, size in sizes:
        if batch and total + size > limit:
            yield batch
            batch, total = [], 0
        batch.append(index)
        total += size
    if batch:
        yield batch


def local_slice(param: torch.Tensor, full: torch.Tensor, tp, padded_vocab: int) -> torch.Tensor:
    """The inverse of `full_tensors`: pad the vocabulary, then take this rank's shard."""
    if role_of(param).vocab_padded and full.shape[0] < padded_vocab:
        pad = torch.zeros((padded_vocab - full.shape[0],) + tuple(full.shape[1:]), dtype=full.dtype)
        full = torch.cat([full, pad])
    dim = role_of(param).tp_split_dim
    if dim is not None and tp.size > 1:
        full = full.chunk(tp.size, dim=dim)[tp.rank]
    return full


def gather_full_state(named_params, tp, vocab_size: int, grads: bool = False,
                      value_of=None) -> dict:
    """{global name: full fp32 CPU tensor} for the whole model, on every rank.

    `named_params` yields (global name, parameter) for this rank's chunks. Duplicates (the last
    stage's tied embedding copy) are skipped. The value gathered is the parameter, its .grad
    (`grads`) or `value_of(parameter)`. Meant for tests and conversion, not hot paths.
    """
    items = {}
    for name, param in named_params:
        if role_of(param).duplicate:
            continue
        value = value_of(param) if value_of else param.grad if grads else param
        items[name] = (param, torch.zeros_like(param) if value is None else value)
    full = full_tensors(list(items.values()), tp, vocab_size)
    mine = {name: value.cpu().numpy() for name, value in zip(items, full)}
    # Exchanged as numpy arrays, which pickle as their bytes: tensors go through torch's own
    # reducer and loader, several times slower (the equivalence tests call this per run).
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {name: torch.from_numpy(array) for part in gathered for name, array in part.items()}
