"""A mixture of experts' weights in Megatron's checkpoints: expert-parallel files, the
grouped layout, and torch_dist's stacked experts, all turned into (and out of) the full
Megatron state's one name per expert, `...mlp.experts.local_experts.{j}.linear_fc1.weight` with
j the global expert index (ptdp/megatron/names.py maps those to ptdp's names).

* Legacy files (`--ckpt-format torch`): expert-parallel rank r of e holds experts
  [r E/e, (r+1) E/e) numbered from 0 (megatron-core's SequentialMLP `local_experts`) in
  `mp_rank_TT[_PPP]_EEE` (ptdp/megatron/files.py); everything else is repeated on every r.
* megatron-core's GroupedMLP (`--moe-grouped-gemm` without TransformerEngine) holds a rank's
  experts in two tensors, `mlp.experts.weight1` [h, E_r * X] and `weight2` [E_r * Y, h]
  (X, Y: this tensor rank's fc1 outputs and fc2 inputs), read as `weight1.view(E_r, h, X)` and
  `weight2.view(E_r, Y, h)` (megatron/core/transformer/moe/experts.py GroupedMLP.forward):
  expert j's fc1 weight is `weight1.view(E_r, h, X)[j].T` and its fc2 weight
  `weight2.view(E_r, Y, h)[j].T`, a column- and a row-parallel shard as SequentialMLP's.
* torch_dist stores each expert linear once for all experts, [E, out, in] under
  `...mlp.experts.experts.linear_fc1.weight` (SequentialMLP.sharded_state_dict), the layers
  stacked in front when every layer is alike.
"""

from __future__ import annotations

import re

import torch

# megatron-core's name of one expert's parameter: PREFIX (up to and with `mlp.experts.`, the
# layer's path before it if any), `local_experts.`, the expert's index, `.`, REST
# (`linear_fc1.weight`, ...). Every module of ptdp/megatron reads expert names through
# `expert_name` and writes them through `local_name` / `stacked_name`.
_LOCAL = re.compile(r"^((?:.*\.)?mlp\.experts\.)local_experts\.(\d+)\.(.*)$")
_STACKED = re.compile(r"^(.*\.mlp\.experts\.)experts\.(.*)$")
_GROUPED = re.compile(r"^(.*\.mlp\.experts\.)weight([12])$")


def expert_name(name: str) -> tuple[str, int, str] | None:
    """`PREFIX local_experts.{j}.REST` -> (PREFIX, j, REST); None for any other name."""
    match = _LOCAL.match(name)
    return None if match is None else (match.group(1), int(match.group(2)), match.group(3))


def local_name(prefix: str, j: int, rest: str) -> str:
    """The inverse of `expert_name`: expert j's parameter REST."""
    return f"{prefix}local_experts.{j}.{rest}"


def stacked_name(prefix: str, rest: str) -> str:
    """torch_dist's one name for parameter REST of every expert (stacked along dim 0)."""
    return f"{prefix}experts.{rest}"


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def renumbered(state: dict, offset: int) -> dict:
    """`local_experts.{j}` -> `local_experts.{offset + j}` (a file's experts -> global)."""
    out = {}
    for name, value in state.items():
        if parts := expert_name(name):
            prefix, j, rest = parts
            name = local_name(prefix, offset + j, rest)
        out[name] = value
    return out


def from_grouped(state: dict, hidden: int, count: int) -> dict:
    """A rank's GroupedMLP `weight1` / `weight2` (its `count` experts) -> SequentialMLP's
    names."""
    out, grouped = {}, {}
    for name, value in state.items():
        if match := _GROUPED.match(name):
            grouped.setdefault(match.group(1), {})[match.group(2)] = value
        else:
            out[name] = value
    for prefix, pair in grouped.items():
        w1 = pair["1"].reshape(count, hidden, -1)
        w2 = pair["2"].reshape(count, -1, hidden)
        for j in range(count):
            out[local_name(prefix, j, "linear_fc1.weight")] = w1[j].t().contiguous()
            out[local_name(prefix, j, "linear_fc2.weight")] = w2[j].t().contiguous()
    return out


def to_grouped(state: dict, hidden: int) -> dict:
    """A rank's SequentialMLP expert names -> GroupedMLP's `weight1` / `weight2`."""
    out, experts = {}, {}
    for name, value in state.items():
        prefix, j, rest = expert_name(name) or (None, None, "")
        if rest in ("linear_fc1.weight", "linear_fc2.weight"):
            which = "1" if rest.startswith("linear_fc1") else "2"
            experts.setdefault(prefix, {})[j, which] = value
        elif not rest.endswith("_extra_state"):
            out[name] = value
    for prefix, parts in experts.items():
        count = 1 + max(j for j, _ in parts)
        w1 = torch.stack([parts[j, "1"].t() for j in range(count)])   # [E_r, h, X]
        w2 = torch.stack([parts[j, "2"].t() for j in range(count)])   # [E_r, Y, h]
        out[f"{prefix}weight1"] = w1.reshape(hidden, -1).contiguous()
        out[f"{prefix}weight2"] = w2.reshape(-1, hidden).contiguous()
    return out


def unstacked(state: dict) -> dict:
    """torch_dist's `...experts.experts.X` [E, ...] -> `...experts.local_experts.{j}.X`."""
    out = {}
    for name, value in state.items():
        if (match := _STACKED.match(name)) and isinstance(value, torch.Tensor):
            for j, expert in enumerate(value.unbind(0)):
                out[local_name(match.group(1), j, match.group(2))] = expert
        else:
            out[name] = value
    return out


def stacked(state: dict) -> dict:
    """`...experts.local_experts.{j}.X` for every j -> torch_dist's `...experts.experts.X`."""
    out, experts = {}, {}
    for name, value in state.items():
        if parts := expert_name(name):
            prefix, j, rest = parts
            experts.setdefault(stacked_name(prefix, rest), {})[j] = value
        else:
            out[name] = value
    for name, per_expert in experts.items():
        out[name] = torch.stack([per_expert[j] for j in range(len(per_expert))])
    return out
