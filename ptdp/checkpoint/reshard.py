"""Resharding: checkpoints move between any two layouts (p, t, d, v).

Shards are layout-specific, but the global names, full shapes and split dims in the metadata
are not. A loading rank rebuilds the full tensor of each of its parameters from the saved
shards (`ShardReader`: concatenate along tp_split_dim, trim vocab padding) and slices it for
its own layout with `ptdp.parallel.sharding.local_slice`. `save_full_state` goes the other way
for `ptdp convert`: full weights into the shards a given layout's ranks would save.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ptdp.checkpoint.integrity import DamagedCheckpoint, expected_checksum, load_verified
from ptdp.checkpoint.layout import CheckpointError, param_file_name
from ptdp.parallel.roles import role_of
from ptdp.parallel.sharding import local_slice


def param_metadata(param, tensor_size: int, vocab_size: int, pipeline_rank: int) -> dict:
    """Full (layout-free) shape of `param` and how a layout with `tensor_size` tensor ranks
    split it, as a checkpoint's metadata records it."""
    role = role_of(param)
    shape = list(param.shape)
    if role.tp_split_dim is not None:
        shape[role.tp_split_dim] *= tensor_size
    if role.vocab_padded:
        shape[0] = vocab_size
    return {"shape": shape, "tp_split_dim": role.tp_split_dim, "vocab_padded": role.vocab_padded,
            "pipeline_rank": pipeline_rank}


class ShardReader:
    """Full tensors of saved parameters, rebuilt from the shard files of the saved layout."""

    def __init__(self, directory: Path, meta: dict):
        self.directory, self.meta = directory, meta
        self.tensor = meta["layout"]["tensor"]
        self.vocab_size = meta["model"]["vocab_size"]
        self._files: dict[str, dict] = {}

    def full(self, name: str) -> dict:
        """{"value", "exp_avg", "exp_avg_sq": full tensors, "step"} for global `name`."""
        info = self.meta["params"].get(name)
        if info is None:
            raise CheckpointError(f"{self.directory} has no parameter '{name}'")
        parts = [self._shard(param_file_name(info, tp), name) for tp in range(self.tensor)]
        entry = {key: self._unshard([p[key] for p in parts], info)
                 for key in parts[0] if key != "step"}
        if "step" in parts[0]:
            entry["step"] = parts[0]["step"]
        expected = list(info["shape"])
        if list(entry["value"].shape) != expected:
            raise DamagedCheckpoint(f"{self.directory}: parameter '{name}' rebuilds to shape "
                                  f"{list(entry['value'].shape)}, metadata says {expected}")
        return entry

    def _unshard(self, parts: list, info: dict):
        dim = info["tp_split_dim"]
        full = torch.cat(parts, dim=dim) if dim is not None else parts[0]
        return full[: self.vocab_size] if info["vocab_padded"] else full

    def _shard(self, file: str, name: str) -> dict:
        shard = self._file(file).get(name)
        if shard is None:
            raise DamagedCheckpoint(f"{self.directory / file} has no entry for "
                                  f"parameter '{name}' (the metadata says it is there)")
        return shard

    def _file(self, key: str) -> dict:
        if key not in self._files:
            # mmap: only the tensors this rank asks for are copied out (after one checksum pass)
            self._files[key] = load_verified(self.directory / key,
                                             expected_checksum(self.meta, key), mmap=True)
        return self._files[key]


def to_local(param, full: torch.Tensor, tp, padded_vocab: int, name: str,
             key: str) -> torch.Tensor:
    """This rank's shard of `full` for the current layout, checked against the parameter."""
    local = local_slice(param, full, tp, padded_vocab)
    if local.shape != param.shape:
        raise CheckpointError(f"parameter '{name}' ({key}): the checkpoint gives a shard of shape "
                              f"{list(local.shape)} but the model's is {list(param.shape)}")
    return local.clone()  # own the memory: the source may be a memory-mapped file
