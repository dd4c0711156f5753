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


def full_tensor(param: torch.Tensor, value: torch.Tensor, tp, vocab_size: int) -> torch.Tensor:
    """All-gather `value` (the param or its grad) over the tensor group; trim vocab padding."""
    dim = role_of(param).tp_split_dim
    if dim is not None and tp.size > 1:
        parts = [torch.empty_like(value) for _ in range(tp.size)]
        dist.all_gather(parts, value.contiguous(), group=tp.group)
        value = torch.cat(parts, dim=dim)
    if role_of(param).vocab_padded:
        value = value[:vocab_size]
    return value.detach().clone()


def local_slice(param: torch.Tensor, full: torch.Tensor, tp, padded_vocab: int) -> torch.Tensor:
    """The inverse of `full_tensor`: pad the vocabulary, then take this rank's shard."""
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
    mine = {}
    for name, param in named_params:
        if role_of(param).duplicate:
            continue
        value = value_of(param) if value_of else param.grad if grads else param
        if value is None:
            value = torch.zeros_like(param)
        mine[name] = full_tensor(param, value, tp, vocab_size).float().cpu().numpy()
    # Exchanged as numpy arrays, which pickle as their bytes: tensors go through torch's own
    # reducer and loader, several times slower (the equivalence tests call this per run).
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {name: torch.from_numpy(array) for part in gathered for name, array in part.items()}
