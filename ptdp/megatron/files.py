"""Finding a Megatron-LM checkpoint on disk and reading its pickles without Megatron.

Megatron-LM's layout (megatron/training/checkpointing.py in Megatron-LM):
  DIR/latest_checkpointed_iteration.txt   the newest iteration, or "release"
  DIR/iter_0000100/ or DIR/release/       one iteration
    legacy ("--ckpt-format torch"):    mp_rank_TT/model_optim_rng.pt (pipeline size 1) or
                                       mp_rank_TT_PPP/model_optim_rng.pt
    torch_dist (the default format):   metadata.json, common.pt, .metadata, __R_I.distcp

Its files are pickles holding an argparse Namespace and, in places, Megatron's own classes
(enums, the rerun state machine). `load` unpickles them without importing Megatron: a class
of megatron, transformer_engine, apex or modelopt becomes an opaque stand-in, which is fine
because the conversion reads only tensors, numbers and the args' plain values. Like
Megatron-LM's own loader this runs the pickle (`weights_only=False`): convert only
checkpoints you trust.
"""

from __future__ import annotations

import os
import pickle
import re
import types
from pathlib import Path

import torch

from ptdp.megatron.errors import MegatronConversionError, require

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
_ITER_DIR = re.compile(r"iter_(\d{7})$")
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_OPAQUE_PACKAGES = ("megatron", "transformer_engine", "apex", "modelopt", "nvidia_resiliency_ext")

CHECKPOINT_VERSION = 3.0


class Opaque:
    """Stands in for a class of a package this process does not import."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.split(".")[0] in _OPAQUE_PACKAGES:
            return type(name, (Opaque,), {"__module__": module})
        return super().find_class(module, name)


_PICKLE = types.ModuleType("ptdp_megatron_pickle")
_PICKLE.Unpickler = _Unpickler
_PICKLE.load = lambda file, **kw: _Unpickler(file, **kw).load()
_PICKLE.__dict__.update({k: getattr(pickle, k) for k in ("Pickler", "dump", "dumps")})


def load(path: str | os.PathLike) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)
    except Exception as err:   # torch and pickle raise many types for a bad file
        raise MegatronConversionError(f"{path}: cannot read it ({type(err).__name__}: "
                                      f"{str(err).splitlines()[0] if str(err) else ''})") from None


def iteration_dir(path: str | os.PathLike) -> tuple[Path, int]:
    """(iteration directory, iteration) of a checkpoint root (its tracker file names the
    iteration), an iter_NNNNNNN directory, or a release directory (iteration 0)."""
    path = Path(path)
    require(path.is_dir(), f"{path}: no such directory")
    if (path / TRACKER).is_file():
        text = (path / TRACKER).read_text().strip()
        if text == "release":
            return _existing(path / "release"), 0
        require(text.isdigit(), f"{path / TRACKER} holds {text!r}: not an iteration number")
        return _existing(path / f"iter_{int(text):07d}"), int(text)
    if match := _ITER_DIR.match(path.name):
        return path, int(match.group(1))
    if path.name == "release":
        return path, 0
    raise MegatronConversionError(f"{path}: not a Megatron checkpoint (no {TRACKER}, not an "
                                  f"iter_NNNNNNN or release directory)")


def _existing(path: Path) -> Path:
    require(path.is_dir(), f"{path.parent / TRACKER} names {path.name}, which does not exist")
    return path


def is_torch_dist(directory: Path) -> bool:
    return (directory / "metadata.json").is_file()


def rank_names(directory: Path) -> dict[tuple[int, ...], Path]:
    """{(tensor rank, then each number after it): model_optim_rng.pt} of a legacy iteration
    directory: `mp_rank_TT`, `mp_rank_TT_PPP`, `mp_rank_TT_PPP_EEE` or, with expert but no
    pipeline parallelism, `mp_rank_TT_EEE` (megatron/training/checkpointing.py
    `get_checkpoint_name`); `rank_files` tells the last two apart by the args."""
    found = {}
    for sub in sorted(directory.iterdir()):
        match = _RANK_DIR.match(sub.name)
        if match and (sub / MODEL_FILE).is_file():
            found[tuple(int(g) for g in match.groups() if g is not None)] = sub / MODEL_FILE
    require(found, f"{directory}: no mp_rank_*/{MODEL_FILE} and no metadata.json: neither a "
                   f"legacy nor a torch_dist Megatron checkpoint")
    return found


def rank_files(directory: Path, found: dict,
               single_is_expert: bool) -> dict[tuple[int, int, int], Path]:
    """{(tensor, pipeline, expert rank): file} of `rank_names`' files; `single_is_expert`: a
    lone number after the tensor rank is the expert rank (the args say expert parallelism
    without pipeline parallelism). Refuses a missing file."""
    files = {}
    for key, path in found.items():
        t, rest = key[0], list(key[1:])
        e = rest.pop() if len(rest) == 2 or (rest and single_is_expert) else 0
        files[t, rest[0] if rest else 0, e] = path
    tensor, pipeline, expert = (1 + max(key[i] for key in files) for i in range(3))
    for t in range(tensor):
        for p in range(pipeline):
            for e in range(expert):
                name = rank_dir_name(t, p, e, pipeline, expert)
                require((t, p, e) in files, f"{directory / name / MODEL_FILE} is missing (the "
                                            f"other files are a {tensor}-way tensor, {pipeline}"
                                            f"-way pipeline, {expert}-way expert split)")
    return files


def rank_dir_name(tensor_rank: int, pipeline_rank: int, expert_rank: int, pipeline: int,
                  expert: int) -> str:
    """Megatron-LM's rank folder name (`get_checkpoint_name`)."""
    return (f"mp_rank_{tensor_rank:02d}" + (f"_{pipeline_rank:03d}" if pipeline > 1 else "")
            + (f"_{expert_rank:03d}" if expert > 1 else ""))


def write_tracker(root: Path, iteration: int) -> None:
    (root / TRACKER).write_text(f"{iteration}\n")
