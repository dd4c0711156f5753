"""Megatron's `torch_dist` checkpoints (megatron.core.dist_checkpointing), read with
`torch.distributed.checkpoint` alone: no process group, no Megatron import.

What megatron-core 0.16 writes: `common.pt` (everything that is not sharded: Megatron-LM
puts 'args', 'iteration' and 'checkpoint_version' there), `metadata.json`
({"sharded_backend": "torch_dist", ...}) and the `.distcp` files with their `.metadata`. The
sharded keys are layout-free: every tensor is stored at its full (all tensor ranks) shape,
the layers of a block stacked along a leading dimension under one key without a layer
number (`decoder.layers.self_attention.linear_qkv.weight`, [num_layers, 3h, h]) whatever
the pipeline split (multi-token prediction's depths numbered, `mtp.layers.{j}.`), the norms
under TransformerEngine's fused names, SwiGLU's fc1 as [gate (f rows); up (f rows)] and the
word table padded to padded_vocab_size. Optimizer states, RNG states and `_extra_state`
objects are other keys, not read.

Writing makes the same keys with `torch.distributed.checkpoint.save` (one process, no group):
what megatron-core's `dist_checkpointing.load` asks of a model's `sharded_state_dict()`,
including each layer module's `_extra_state` object (`KEY/shard_I_L` for layer I of L,
holding [None] as megatron-core stores a list of the shards' objects).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ptdp.megatron import experts, files
from ptdp.megatron.errors import require
from ptdp.megatron.names import extra_states, local_norm_names, written_norm_names

MODEL_PREFIXES = ("embedding.", "decoder.", "encoder.", "output_layer.", "lm_head.", "pooler.",
                  "binary_head.", "mtp.")
_STACKED = re.compile(r"^(decoder|encoder)\.layers\.(?!\d+\.)(.*)$")
_NUMBERED = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.*)$")
METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}


def _metadata(directory: Path) -> dict:
    path = directory / "metadata.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise files.MegatronConversionError(f"{path}: not valid JSON ({err})") from None
    backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
    require(backend == "torch_dist", f"{path}: sharded_backend is {backend!r}; ptdp reads "
                                     f"'torch_dist' (convert zarr checkpoints with Megatron's "
                                     f"tools first)")
    return meta


def _model_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """{key: full tensor} of the model's sharded keys, loaded without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(directory))
    try:
        meta = reader.read_metadata()
    except Exception as err:   # a missing or foreign .metadata
        raise files.MegatronConversionError(f"{directory}: cannot read .metadata ({err})") from None
    state = {key: torch.empty(item.size, dtype=item.properties.dtype)
             for key, item in meta.state_dict_metadata.items()
             if isinstance(item, TensorStorageMetadata) and key.startswith(MODEL_PREFIXES)}
    require(state, f"{directory}: the checkpoint holds no model weights")
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as err:   # a damaged .distcp (dcp's exception is a
        # BaseException carrying each rank's traceback)
        raise files.MegatronConversionError(
            f"{directory}: cannot read the weights ({_first_failure(err)})") from None
    return state


def _first_failure(err: BaseException) -> str:
    """One line for dcp's CheckpointException (its text is every rank's traceback): the first
    underlying error's type and first line."""
    failures = getattr(err, "failures", None) or {}
    cause = next(iter(failures.values()), err)
    cause = getattr(cause, "exc", cause)   # a WrappedException holds the original
    text = (str(cause).strip().splitlines() or [""])[0]
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


def _unstacked(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """decoder.layers.X [L, ...] -> decoder.layers.{i}.X for each layer i."""
    out = {}
    for key, value in state.items():
        if match := _STACKED.match(key):
            for i, layer in enumerate(value.unbind(0)):
                out[f"{match.group(1)}.layers.{i}.{match.group(2)}"] = layer
        else:
            out[key] = value
    return out


def read(directory: Path) -> tuple[object, dict[str, torch.Tensor], dict]:
    """(args, full Megatron state, learning-rate scheduler state) of a torch_dist iteration
    directory."""
    _metadata(directory)
    common = directory / "common.pt"   # Megatron-LM keeps its args there; other trainers not
    saved = files.load(common) if common.is_file() else {}
    args = saved.get("args") if isinstance(saved, dict) else None
    scheduler = (saved.get("opt_param_scheduler") if isinstance(saved, dict) else None) or {}
    tensors = experts.unstacked(_unstacked(_model_tensors(directory)))
    return args, local_norm_names(tensors), scheduler


def _stacked(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """decoder.layers.{i}.X for every layer i -> decoder.layers.X [L, ...]."""
    layers: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for key, value in state.items():
        if match := _NUMBERED.match(key):
            layers.setdefault(f"{match.group(1)}.layers.{match.group(3)}", {})[
                int(match.group(2))] = value
        else:
            out[key] = value
    for key, per_layer in layers.items():
        require(sorted(per_layer) == list(range(num_layers)), f"'{key}' is not in every layer")
        out[key] = torch.stack([per_layer[i] for i in range(num_layers)])
    return out


def write(state: dict[str, torch.Tensor], cfg, block: str, args, directory: Path,
          iteration: int, fused_norms: bool) -> None:
    """A full Megatron state as a torch_dist iteration directory (`directory`): the experts
    stacked, and the layers too when all are alike (megatron-core's TransformerBlock numbers
    them when --moe-layer-freq makes some dense)."""
    import torch.distributed.checkpoint as dcp
    layers, count = cfg.num_layers, cfg.num_experts
    alike = not count or (cfg.moe_layer_freq == 1 and cfg.moe_first_dense_layers == 0)
    state = written_norm_names(state, cfg, fused_norms, torch_dist=True)
    tensors = experts.stacked(state)
    sharded: dict[str, object] = dict(_stacked(tensors, layers) if alike else tensors)
    for name in extra_states(state, fused_norms):
        sharded[_extra_key(name, layers, count, alike)] = [None]
    # BERT's output layer asks for its own (GPT's does not); an unrequested key is never read
    sharded["output_layer._extra_state/shard_0_1"] = [None]
    directory.mkdir(parents=True, exist_ok=True)
    dcp.save(sharded, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    torch.save({"args": args, "iteration": iteration,
                "checkpoint_version": files.CHECKPOINT_VERSION},
               directory / "common.pt")
    (directory / "metadata.json").write_text(json.dumps(METADATA))


def _extra_key(name: str, layers: int, count: int, alike: bool) -> str:
    """megatron-core's key of a module's `_extra_state` (numbered layer `name`): one shard per
    layer (and per expert) of the stacked dimensions, `KEY/shard_I_L`, `KEY/shard_I.J_L.E`; a
    multi-token-prediction depth's module (`mtp.layers.{j}.`, ptdp/megatron/mtp_names.py) is
    never stacked by layer."""
    if match := _NUMBERED.match(name):
        prefix, layer, rest = (f"{match.group(1)}.layers", int(match.group(2)), match.group(3))
        index, size = ([layer], [layers]) if alike else ([], [])
        key = f"{prefix}.{rest}" if alike else f"{prefix}.{layer}.{rest}"
    else:
        index, size, key = [], [], name
    if expert := experts.expert_name(key):
        key = experts.stacked_name(expert[0], expert[2])
        index, size = index + [expert[1]], size + [count]
    if not index:
        index, size = [0], [1]
    return f"{key}/shard_{'.'.join(map(str, index))}_{'.'.join(map(str, size))}"
