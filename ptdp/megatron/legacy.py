"""Megatron-LM's legacy checkpoint format (`--ckpt-format torch`) both ways: one
`model_optim_rng.pt` per (tensor rank, pipeline rank), each a torch.save dict with 'model'
(or 'model0', 'model1', ... per virtual pipeline chunk), 'args', 'iteration' and
'checkpoint_version' (ptdp/megatron/files.py has the directory layout).

Reading merges the tensor shards of each weight along its partition dimension
(ptdp/megatron/names.py `partition_dim`: column-parallel weights and the vocabulary tables on
dim 0, row-parallel on dim 1, the rest replicated; SwiGLU's fc1 is [gate; up] per rank, so the
gate halves and the up halves are joined apart) and renumbers layers: a chunk's names count its
own layers from 0, and chunk k of pipeline rank s holds layers from
k * L / V + s * L / (P * V) (megatron-core's `get_transformer_layer_offset`, even split), or
with an uneven split (`--decoder-first/last-pipeline-num-layers`, the embedding or loss
accounted in the split, a layout) from the start of virtual stage k * P + s
(ptdp/megatron/pipeline_layers.py, `counts_from_args`).
Writing does the inverse, with the last stage's copy of a tied word table as
`output_layer.weight` and `_extra_state: None` for each of a layer's modules that megatron-core
gives one (names.py `extra_states`); experts as ptdp/megatron/experts.py says.

Multi-token prediction (`mtp.layers.{j}.*`, ptdp/megatron/mtp_names.py) lives on the last
stage, with megatron-core's copy of the word table there (`embedding.word_embeddings.weight`,
kept equal to the first stage's; read from the first stage only) and, tied, an
`output_layer.weight` megatron-core allocates but never uses (the logits take the embedding's:
gpt_model.py `shared_embedding_or_output_weight`), written as the word table.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ptdp.config import ModelConfig
from ptdp.config.stages import StageMap, layer_ranges
from ptdp.megatron import experts, files
from ptdp.megatron.converters import Unmapped
from ptdp.megatron.pipeline_layers import counts_from_args
from ptdp.megatron.errors import require
from ptdp.megatron.names import (extra_states, fused_norm_names, is_gated_fc1, local_norm_names,
                                partition_dim, written_norm_names)

_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.*)$")
WORD = "embedding.word_embeddings.weight"


def _chunks(saved: dict, path: Path) -> list[dict]:
    """The model state dict of each virtual pipeline chunk, in chunk order."""
    if "model" in saved:
        return [saved["model"]]
    numbered = sorted((int(k[5:]), v) for k, v in saved.items()
                      if k.startswith("model") and k[5:].isdigit())
    require(numbered, f"{path} has no 'model' state dict")
    return [v for _, v in numbered]


def layer_offset(num_layers: int, pipeline: int, chunks: int, rank: int, chunk: int,
                 counts: list[int] | None = None) -> int:
    """The first global layer of chunk `chunk` of pipeline rank `rank`; `counts`: the layers of
    every virtual stage when uneven."""
    stage = StageMap(pipeline, chunks).stage(rank, chunk)   # Megatron's looped placement
    return layer_ranges(num_layers, pipeline * chunks, counts)[stage].start


def _renumbered(state: dict, offset: int) -> dict:
    out = {}
    for name, value in state.items():
        if match := _LAYER.match(name):
            name = f"{match.group(1)}.layers.{offset + int(match.group(2))}.{match.group(3)}"
        out[name] = value
    return out


def _stage_counts(args, pipeline: int, chunks: int) -> list[int] | None:
    """The layers of each virtual stage of the saved job (None: even), or a one-line refusal."""
    try:
        counts = counts_from_args(args, pipeline, chunks)
    except Unmapped as err:
        require(False, f"an uneven pipeline split ptdp cannot hold: {err.why}")
    layers = args.num_layers
    require(counts is not None or layers % (pipeline * chunks) == 0,
            f"num_layers={layers} does not split into {pipeline} pipeline stages x {chunks} "
            f"virtual chunks evenly")
    return counts


def _merge(name: str, shards: list[torch.Tensor], gated: bool) -> torch.Tensor:
    dim = partition_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if gated:   # each rank: [its gate rows; its up rows]
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def _rank_state(path: Path, saved: dict, args, rank: tuple[int, int, int],
                split: tuple[int, int]) -> tuple[dict, dict]:
    """({global name: this file's tensor}, its learning-rate scheduler state) of one rank's
    file (`rank`: tensor, pipeline, expert rank; `split`: pipeline and expert sizes). An
    expert rank past 0 gives only its experts (the rest repeats rank 0's)."""
    version = saved.get("checkpoint_version", files.CHECKPOINT_VERSION)
    require(version >= files.CHECKPOINT_VERSION,
            f"{path}: checkpoint_version {version}: before 3.0 Megatron ordered the QKV rows "
            f"otherwise; re-save it with a current Megatron-LM first")
    (_, stage, expert_rank), (pipeline, expert) = rank, split
    chunks = _chunks(saved, path)
    counts = _stage_counts(args, pipeline, len(chunks))
    local_experts = (getattr(args, "num_experts", None) or 0) // expert
    out = {}
    for k, chunk in enumerate(chunks):
        offset = layer_offset(args.num_layers, pipeline, len(chunks), stage, k, counts)
        chunk = experts.from_grouped(chunk, args.hidden_size, local_experts)
        chunk = experts.renumbered(chunk, expert_rank * local_experts)
        out.update((name, value) for name, value in
                   _renumbered(local_norm_names(chunk), offset).items()
                   if isinstance(value, torch.Tensor)
                   and (expert_rank == 0 or experts.is_expert(name))
                   and (name != WORD or (stage, k) == (0, 0)))   # the MTP stage's copy
    return out, saved.get("opt_param_scheduler") or {}


def read(directory: Path) -> tuple[object, dict[str, torch.Tensor], dict]:
    """(args, full Megatron state, learning-rate scheduler state) of a legacy iteration
    directory of any split."""
    found = files.rank_names(directory)
    first = files.load(found[min(found)])
    args = first.get("args")
    require(args is not None, f"{found[min(found)]} has no 'args': the model's shape comes from "
                              f"them (Megatron-LM saves them in every legacy file)")
    paths = files.rank_files(directory, found, _single_is_expert(args))
    tensor, pipeline, expert = (1 + max(key[i] for key in paths) for i in range(3))
    shards: dict[str, list[torch.Tensor]] = {}   # name -> one tensor per tensor rank, in order
    scheduler = {}
    for rank in sorted(paths, key=lambda r: (r[2], r[1], r[0])):
        saved = first if paths[rank] == found[min(found)] else files.load(paths[rank])
        state, scheduler = _rank_state(paths[rank], saved, args, rank, (pipeline, expert))
        for name, value in state.items():
            shards.setdefault(name, []).append(value)
    gated = bool(getattr(args, "swiglu", False))
    merged = {}
    for name, values in shards.items():
        require(len(values) == tensor, f"'{name}' is on {len(values)} of {tensor} tensor ranks "
                                       f"(or on more than one pipeline stage)")
        merged[name] = _merge(name, values, gated and ".linear_fc1." in name)
    return args, merged, scheduler


def _single_is_expert(args) -> bool:
    """Whether `mp_rank_TT_NNN` names expert rank NNN: expert but no pipeline parallelism."""
    return (getattr(args, "expert_model_parallel_size", 1) or 1) > 1 and \
        (getattr(args, "pipeline_model_parallel_size", 1) or 1) == 1


def _split(name: str, value: torch.Tensor, tensor: int, cfg: ModelConfig) -> list[torch.Tensor]:
    dim = partition_dim(name)
    if dim is None or tensor == 1:
        return [value] * tensor
    if is_gated_fc1(name, cfg):
        gate, up = (h.chunk(tensor, dim=0) for h in value.chunk(2, dim=0))
        return [torch.cat([g, u], dim=0) for g, u in zip(gate, up)]
    return list(value.chunk(tensor, dim=dim))


def _stage_of(name: str, cfg: ModelConfig, pipeline: int) -> tuple[int, str]:
    """(pipeline rank, local name) of a weight of the full Megatron state."""
    if match := _LAYER.match(name):
        per_stage = cfg.num_layers // pipeline
        index = int(match.group(2))
        return index // per_stage, f"{match.group(1)}.layers.{index % per_stage}.{match.group(3)}"
    return (0 if name.startswith("embedding.") else pipeline - 1), name


def write(state: dict[str, torch.Tensor], cfg: ModelConfig, args, root: Path, iteration: int,
          split: tuple[int, int, int], fused_norms: bool, grouped: bool = False) -> Path:
    """Write a full Megatron state as `root/iter_N/mp_rank_*/model_optim_rng.pt` plus the
    tracker for `split` = (tensor, pipeline, expert) ranks; `grouped`: the experts in
    GroupedMLP's two tensors. Returns the iteration directory."""
    tensor, pipeline, expert = split
    require(cfg.num_layers % pipeline == 0, f"num_layers={cfg.num_layers} does not split into "
                                            f"{pipeline} pipeline stages")
    require(cfg.num_kv_heads % tensor == 0, f"{cfg.num_kv_heads} query groups do not split "
                                            f"over {tensor} tensor ranks")
    require(cfg.num_experts % expert == 0, f"{cfg.num_experts} experts do not split over "
                                           f"{expert} expert-parallel ranks")
    if cfg.tie_embeddings and pipeline > 1:   # the last stage's own copy of the word table
        state = dict(state, **{"output_layer.weight": state["embedding.word_embeddings.weight"]})
    dicts = {(t, p): {} for t in range(tensor) for p in range(pipeline)}
    if cfg.latent_attention:   # by global layer numbers (a dense layer's pre-MLP norm fuses)
        state = written_norm_names(state, cfg, fused_norms)
    for name, value in state.items():
        p, local = _stage_of(name, cfg, pipeline)
        for t, shard in enumerate(_split(name, value, tensor, cfg)):
            dicts[t, p][local] = shard.clone().contiguous()
            if name == WORD and cfg.mtp_layers and pipeline > 1:   # the depths embed tokens
                dicts[t, pipeline - 1][local] = shard.clone().contiguous()
    final = root / f"iter_{iteration:07d}"
    local_experts = cfg.num_experts // expert
    for (t, p), model in dicts.items():
        model = fused_norm_names(model) if fused_norms and not cfg.latent_attention else model
        model.update(extra_states(model, fused_norms))
        if p == pipeline - 1:   # the output layer is a ColumnParallelLinear, tied or not
            model["output_layer._extra_state"] = None
        for e in range(expert):
            mine = experts.renumbered(_experts_of_rank(model, e, local_experts),
                                      -e * local_experts)
            if grouped:
                mine = experts.to_grouped(mine, cfg.hidden_size)
            sub = final / files.rank_dir_name(t, p, e, pipeline, expert)
            sub.mkdir(parents=True, exist_ok=True)
            torch.save({"args": args, "checkpoint_version": files.CHECKPOINT_VERSION,
                        "iteration": iteration, "model": mine}, sub / files.MODEL_FILE)
    files.write_tracker(root, iteration)
    return final


def _experts_of_rank(model: dict, rank: int, local_experts: int) -> dict:
    """A rank file's state: everything but the experts, and expert rank `rank`'s experts."""
    out = {}
    for name, value in model.items():
        parts = experts.expert_name(name)
        if parts is None or parts[1] // local_experts == rank:
            out[name] = value
    return out
