"""`ptdp convert --from megatron` / `--to megatron`: Megatron-LM checkpoints of GPT and BERT
(megatron-core models) <-> ptdp checkpoints, as ptdp/hf/convert.py does for Hugging Face.

Megatron -> ptdp: the format is recognised (legacy `mp_rank_*` files, ptdp/megatron/legacy.py,
or torch_dist, ptdp/megatron/torch_dist.py), the weights gathered into one full Megatron state,
the model shape read from the checkpoint's args (ptdp/megatron/model_args.py, refusing in one
line what ptdp's model cannot compute), the names and SwiGLU rows mapped
(ptdp/megatron/names.py) and the result written as a checkpoint of the layout the overrides
ask for (ptdp/checkpoint/save.py `save_full_state`) at Megatron's iteration, which
`ptdp train ... checkpoint.load=OUT` continues from (fresh optimizer state).

ptdp -> Megatron: the full weights of a checkpoint of any layout
(ptdp/inference/local_model.py), the vocabulary padded as Megatron pads it, written as
torch_dist (Megatron-LM's default format, layout-free) or in the legacy format split for the
requested tensor/pipeline sizes, with an `args` Namespace Megatron-LM's loader accepts.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from ptdp.megatron import files, legacy, shape, torch_dist
from ptdp.megatron.load_command import load_flags
from ptdp.megatron.model_args import (megatron_args, model_config, notes, refuse_for_megatron,
                                      vocab_divisor)
from ptdp.megatron.tokenizer_args import tokenizer_args
from ptdp.megatron.errors import require
from ptdp.megatron.names import (VOCAB_ROWS, arch_of, block_name, expert_biases, to_megatron,
                                to_ptdp)

TRANSFORMER_IMPLS = ("transformer_engine", "local")
# megatron-core's latent down-projections are column-parallel in its local spec, replicated in
# TransformerEngine's: legacy files split over tensor ranks are not converted yet
_LATENT_SPLIT = ("latent attention in legacy files split over {} tensor ranks: the converter "
                 "does not split or gather MLA's down-projections yet; use --ckpt-format "
                 "torch_dist (layout-free) or tensor size 1")
FORMATS = ("torch_dist", "torch")   # Megatron-LM's --ckpt-format names; torch = legacy


def read_megatron(path: str | os.PathLike, overrides=()) -> dict:
    """{'format', 'directory', 'iteration', 'args', 'arch', 'model' (ModelConfig of the args),
    'megatron' (the full Megatron state), 'state' (ptdp's full weights of 'model'), 'notes'}
    of a Megatron checkpoint; one without Megatron-LM's args takes its shape from a config
    beside it and the `model.*` overrides (ptdp/megatron/shape.py)."""
    directory, iteration = files.iteration_dir(path)
    fmt = "torch_dist" if files.is_torch_dist(directory) else "legacy"
    args, mstate, scheduler = (torch_dist if fmt == "torch_dist" else legacy).read(directory)
    arch = arch_of(mstate)
    if args is None:
        given = shape.model_config(arch, directory, mstate, overrides)
        args = megatron_args(given, {"tensor": 1, "pipeline": 1}, given.vocab_size,
                             {"iteration": iteration, "consumed_samples": None}, "local", fmt,
                             tokenizer_args(None, given.vocab_size))
    word = mstate.get("embedding.word_embeddings.weight")
    cfg = model_config(args, arch, None if word is None else word.shape[0])
    require(not (cfg.latent_attention and fmt == "legacy"
                 and (getattr(args, "tensor_model_parallel_size", 1) or 1) > 1),
            _LATENT_SPLIT.format(getattr(args, "tensor_model_parallel_size", 1)))
    if word is not None:
        require(word.shape[0] == cfg.vocab_size,
                f"the word table has {word.shape[0]} rows but padded_vocab_size is "
                f"{cfg.vocab_size}")
    return {"format": fmt, "directory": directory, "iteration": iteration, "args": args,
            "arch": arch, "model": cfg, "megatron": mstate, "state": to_ptdp(cfg, mstate),
            "notes": notes(args, arch), **samples_of(args, scheduler)}


def samples_of(args, scheduler: dict) -> dict:
    """{'consumed_samples', 'skipped_samples'} of the Megatron run, where it recorded them:
    its scheduler advanced by the samples of every iteration fp16 did not skip (`num_steps`),
    so a converted run resumes at Megatron's learning rate (ptdp/optim/lr.py)."""
    consumed = getattr(args, "consumed_train_samples", None)
    steps = scheduler.get("num_steps")
    if consumed is None:
        return {}
    skipped = consumed - steps if steps is not None and 0 <= steps <= consumed else 0
    return {"consumed_samples": int(consumed), "skipped_samples": int(skipped)}


def from_megatron(source: str | os.PathLike, out: str | os.PathLike, overrides=(),
                  iteration: int | None = None, tokenizer: str | None = None):
    """Write a ptdp checkpoint of the layout in `overrides` from a Megatron checkpoint.

    Returns (iteration directory, resolved Config, what was read)."""
    from ptdp.checkpoint.save import conversion_config, save_full_state
    from ptdp.data.tokenizer import checked_tokenizer

    found = read_megatron(source, overrides)
    if tokenizer:
        checked_tokenizer(tokenizer, found["model"].vocab_size)
    cfg = conversion_config(found["model"], overrides, tokenizer)
    require(cfg.model.tie_embeddings == found["model"].tie_embeddings,
            f"model.tie_embeddings={str(cfg.model.tie_embeddings).lower()}: the checkpoint's "
            f"output layer is {'tied to' if found['model'].tie_embeddings else 'separate from'} "
            f"the word table (untie_embeddings_and_output_weights), and converting keeps it so")
    step = found["iteration"] if iteration is None else iteration
    # model.vocab_size / model.seq_length overrides cut the tables (names.py `to_ptdp`)
    state = to_ptdp(cfg.model, found["megatron"])
    progress = ({"consumed_samples": found["consumed_samples"],
                 "skipped_samples": found["skipped_samples"]}
                if iteration is None and "consumed_samples" in found else {})
    biases = expert_biases(cfg.model, found["megatron"])
    final = save_full_state(state, cfg, out, iteration=step, **progress,
                            extra_meta={"moe": {"expert_bias": biases}} if biases else None)
    return final, cfg, found


def _padded(state: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """The vocabulary tables with zero rows up to Megatron's padded_vocab_size."""
    out = dict(state)
    for name in VOCAB_ROWS:
        if name in out and out[name].shape[0] < rows:
            value = out[name]
            pad = value.new_zeros(rows - value.shape[0], *value.shape[1:])
            out[name] = torch.cat([value, pad], dim=0)
    return out


def _tokenizer_of(directory: Path, meta: dict) -> str | None:
    """The tokenizer the run trained with: its data.tokenizer where that file still exists (a
    GPT-2 vocab.json or WordPiece vocab.txt keeps its Megatron tokenizer type; the
    checkpoint's copy is a tokenizer.json), else the checkpoint's copy."""
    from ptdp.inference.local_model import checkpoint_tokenizer
    given = meta.get("config", {}).get("data", {}).get("tokenizer")
    return given if given and Path(given).exists() else checkpoint_tokenizer(directory, meta)


def padded_vocab(vocab: int, tensor: int) -> int:
    """Megatron's padded_vocab_size of `vocab` at `tensor` ranks with make_vocab_size_divisible_by
    from `vocab_divisor` (megatron/training/tokenizer/tokenizer.py `_vocab_size_with_padding`)."""
    multiple = vocab_divisor(vocab, tensor) * tensor
    return multiple * math.ceil(vocab / multiple)


def to_megatron_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike,
                           tensor: int = 1, pipeline: int = 1,
                           transformer_impl: str = "transformer_engine",
                           ckpt_format: str = "torch_dist", expert: int = 1,
                           grouped: bool = False) -> dict:
    """Write a ptdp checkpoint as a Megatron-LM checkpoint: torch_dist (layout-free; the split
    only goes into the args) or legacy ("torch") split (tensor, pipeline, expert), its experts
    as SequentialMLP's or (`grouped`) GroupedMLP's (--moe-grouped-gemm). Returns a short
    summary."""
    from ptdp.inference.local_model import model_config as ptdp_model_config
    from ptdp.inference.local_model import read_full_state

    require(transformer_impl in TRANSFORMER_IMPLS,
            f"--transformer-impl {transformer_impl}: choose {' or '.join(TRANSFORMER_IMPLS)}")
    require(ckpt_format in FORMATS, f"--ckpt-format {ckpt_format}: choose "
                                    f"{' or '.join(FORMATS)}")
    require(tensor >= 1 and pipeline >= 1 and expert >= 1,
            "tensor, pipeline and expert sizes must be at least 1")
    directory, meta, full = read_full_state(checkpoint)
    cfg = ptdp_model_config(meta)
    refuse_for_megatron(cfg)
    for what, size in (("model.ffn_hidden_size", cfg.ffn_hidden_size),
                       ("model.num_kv_heads (query groups)", cfg.num_kv_heads)):
        require(size % tensor == 0, f"{what}={size} does not split over parallel.tensor={tensor} "
                                    f"ranks, as Megatron-LM's split needs")
    require(not (cfg.latent_attention and ckpt_format == "torch" and tensor > 1),
            _LATENT_SPLIT.format(tensor))
    padded = padded_vocab(cfg.vocab_size, tensor)
    train = meta.get("config", {}).get("train", {})
    batch = int(train.get("global_batch_size", 0) or 0)
    progress = {"iteration": meta["iteration"], "global_batch_size": batch or None,
                # (a batch ramp-up: less than iteration * B)
                "consumed_samples": meta.get("consumed_samples", meta["iteration"] * batch)}
    require((expert == 1 and not grouped) or (cfg.num_experts and ckpt_format == "torch"),
            "an expert split and the grouped layout are for the legacy format (--ckpt-format "
            "torch) of a mixture of experts")
    args = megatron_args(cfg, {"tensor": tensor, "pipeline": pipeline, "expert": expert},
                         padded, progress, transformer_impl, ckpt_format,
                         tokenizer_args(_tokenizer_of(directory, meta), cfg.vocab_size))
    args.moe_grouped_gemm = grouped
    biases = meta.get("moe", {}).get("expert_bias")
    state = _padded(to_megatron(cfg, full, biases), padded)
    fused = transformer_impl == "transformer_engine"
    if ckpt_format == "torch":
        final = legacy.write(state, cfg, args, Path(out), meta["iteration"],
                             (tensor, pipeline, expert), fused_norms=fused, grouped=grouped)
    else:
        final = Path(out) / f"iter_{meta['iteration']:07d}"
        torch_dist.write(state, cfg, block_name(cfg), args, final,
                         meta["iteration"], fused_norms=fused)
        files.write_tracker(Path(out), meta["iteration"])
    extra = padded - cfg.vocab_size
    return {"directory": final, "checkpoint": directory, "iteration": meta["iteration"],
            "arch": cfg.arch, "padded_rows": extra, "args": args,
            "load_flags": load_flags(args, split=ckpt_format == "torch"),
            "parameters": sum(v.numel() for v in full.values())}
