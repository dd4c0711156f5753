"""`ptdp convert`: a ptdp checkpoint of any layout <-> a Hugging Face model directory.

The families (ptdp/hf/registry.py; docs/models.md has the table): GPT-2 (ptdp/hf/gpt2.py),
Megatron-BERT (megatron_bert.py), Llama, Mistral, Qwen2 and Qwen3 (llama.py), Gemma
(gemma.py, which also names why Gemma 2 and 3 are refused), Phi-3 (phi3.py), Mixtral,
Qwen2-MoE and Qwen3-MoE (moe.py), DeepSeek-V3 (deepseek.py, with its multi-token-prediction
layers beside transformers': mtp.py). Each maps its config and its weights both ways; anything it
cannot reproduce exactly is refused in one line (`ConversionError`) before anything is
written.

ptdp -> HF: the full weights (ptdp/inference/local_model.py reads any (p, t, d, v), 2BW
included), the HF class chosen from the model's block options (or named: `model_type`),
saved with `save_pretrained` (model.safetensors + config.json + generation_config.json with
every end id), plus the checkpoint's tokenizer files (ptdp/hf/tokenizer.py).

HF -> ptdp: config.json read and checked, the weights loaded with transformers (a weight that
config.json asks for and the files lack, or one it has no place for, is refused), mapped back
and written as a checkpoint of the layout the overrides ask for (ptdp/checkpoint/save.py
`save_full_state`), with the directory's tokenizer files; `ptdp train ... checkpoint.load=OUT`
continues from it (with fresh optimizer state). Of the model keys the overrides may set only
model.seq_length (a rotary model: up to its max_position_embeddings, default 4096; a learned
table is cut to it), the dropout rates and model.mtp_loss_scale.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import fields, replace
from pathlib import Path

from ptdp.data.tokenizer import checked_tokenizer
from ptdp.config import ModelConfig
from ptdp.hf.base import ConversionError, Family, require
from ptdp.hf.gemma import REFUSED
from ptdp.hf.mtp import (depth_prefixes, prediction_depths, read_depths, split_depths,
                         write_depths)
from ptdp.hf.registry import family_of, family_of_model_type
from ptdp.hf.tokenizer import directory_tokenizer, write_tokenizer
from ptdp.inference.local_model import checkpoint_tokenizer, model_config, read_full_state
from ptdp.inference.prompts import Prompts

_LAYER_NAME = re.compile(r"\.(h|layers|layer)\.\d+\.")   # a weight of one numbered layer
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _quiet_transformers():
    """No progress bars and no warnings of their own: ptdp's refusals say what is wrong."""
    from transformers.utils import logging
    logging.disable_progress_bar()
    logging.set_verbosity_error()


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def to_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
          tokenizer: str | None = None, model_type: str | None = None) -> dict:
    """Write the HF model (and tokenizer, when known) to out_dir, as `model_type` when given
    (else the first family whose block is the model's); returns a short summary."""
    import transformers

    _quiet_transformers()
    directory, meta, state = read_full_state(checkpoint)
    cfg = model_config(meta)
    family = family_of(cfg, model_type)
    tok_path = checkpoint_tokenizer(directory, meta, tokenizer)
    tok = checked_tokenizer(tok_path, cfg.vocab_size) if tok_path else None
    config = family.hf_config(cfg, tok.special_ids() if tok else {})
    ends = Prompts(tok_path, tok).end_ids() if tok and cfg.family.generates else []
    if ends:   # every end id (Llama 3 Instruct's <|eot_id|> too), as config.json and the
        config.eos_token_id = ends[0] if len(ends) == 1 else ends   # generation config list them
    config.ptdp = {"checkpoint": str(directory), "iteration": meta["iteration"]}
    model = getattr(transformers, family.hf_class)(config)
    weights = family.to_hf(cfg, state)
    family.meta_to_hf(cfg, meta, weights)
    depths = split_depths(family, cfg, weights)   # the layers transformers' class lacks
    if cfg.moe_capacity_factor is not None:       # training-time routing HF does not have
        print(f"model.moe_capacity_factor={cfg.moe_capacity_factor:g}: {family.hf_class} routes "
              f"dropless, so where an expert's capacity would have bound, its outputs differ "
              f"from the trained model's forward", file=sys.stderr)
    model.load_state_dict(weights, strict=True)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    write_depths(out, depths)
    if tok_path:
        write_tokenizer(tok_path, out, cfg.arch, cfg.max_positions)
    return {"class": family.hf_class, "checkpoint": str(directory),
            "iteration": meta["iteration"], "tokenizer": tok_path,
            "parameters": sum(p.numel() for p in model.parameters())}


def read_hf_config(hf_dir: str | os.PathLike):
    """(family, transformers config, ptdp ModelConfig) of an HF model directory, or a one-line
    ConversionError: no directory, no or invalid config.json, an unknown model_type, or a
    setting ptdp's model would compute differently."""
    hf_dir = Path(hf_dir)
    file = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise ConversionError(f"{hf_dir} is not a directory: give a Hugging Face model directory")
    if not file.is_file():
        raise ConversionError(f"{hf_dir} has no config.json: not a Hugging Face model directory")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConversionError(f"{file} is not valid JSON ({_first_line(err)})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConversionError(f"{file} has no model_type: not a transformers config")
    if raw["model_type"] in REFUSED:
        raise ConversionError(f"{file}: {REFUSED[raw['model_type']](raw)}")
    family = family_of_model_type(raw["model_type"])
    import transformers
    try:
        config = getattr(transformers, family.config_class).from_pretrained(str(hf_dir))
    except Exception as err:  # transformers raises many types for a bad value
        raise ConversionError(f"{file}: transformers cannot read it ({_first_line(err)})") from None
    return family, config, family.model_config(config)


def load_hf_weights(hf_dir: str | os.PathLike, family: Family, config,
                    beside: tuple[str, ...] = ()) -> dict:
    """The HF model's state dict, loaded by transformers, or a one-line ConversionError: no
    weights, unreadable weights, or weights that are not config.json's model (but for those
    whose names start with `beside`: layers read beside transformers)."""
    import torch
    import transformers

    hf_dir = Path(hf_dir)
    if not any((hf_dir / name).is_file() for name in WEIGHT_FILES):
        raise ConversionError(f"{hf_dir} has no model.safetensors: no weights to convert")
    _refuse_integer_weights(hf_dir)
    try:
        model, info = getattr(transformers, family.hf_class).from_pretrained(
            str(hf_dir), config=config, output_loading_info=True, dtype=torch.float32)
    except Exception as err:  # safetensors, torch and transformers each raise their own
        raise ConversionError(f"{hf_dir}: cannot read the weights ({_first_line(err)})") from None
    state = model.state_dict()
    order = {name: i for i, name in enumerate(state)}
    for key, problem, hint in (
            ("missing_keys", "lack {n} tensor(s) that config.json asks for", "more"),
            ("unexpected_keys", "hold {n} tensor(s) config.json has no place for", "fewer"),
            ("mismatched_keys", "have {n} tensor(s) of another shape than config.json's", "")):
        names = [k[0] if isinstance(k, tuple) else k for k in info.get(key) or ()]
        names = [name for name in names if not name.startswith(beside)]
        if names:
            first = min(names, key=lambda name: (order.get(name, len(order)), name))
            layers = (f" (config.json gives {hint} layers than the weights hold)"
                      if hint and _LAYER_NAME.search(first) else "")
            raise ConversionError(f"{hf_dir}: the weights {problem.format(n=len(names))}, the "
                                  f"first '{first}'{layers}")
    return state


def _refuse_integer_weights(hf_dir: Path) -> None:
    """transformers casts every tensor to the dtype asked for, so integer weights (quantized,
    or written wrong) would convert into a silently different model: refuse them, by the
    safetensors headers (no tensor is read)."""
    for path in sorted(hf_dir.glob("*.safetensors")):
        try:
            dtypes = _safetensors_dtypes(path)
        except Exception:   # unreadable: from_pretrained says so in its own words
            continue
        for name, dtype in dtypes.items():
            if not dtype.startswith(("F", "BF")):   # F16, F32, F64, BF16, F8_*
                raise ConversionError(f"{path}: tensor '{name}' is {dtype}, not floating point: "
                                      f"ptdp converts unquantized weights only")


def _safetensors_dtypes(path: Path) -> dict[str, str]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}


def from_hf(hf_dir: str | os.PathLike, out: str | os.PathLike, overrides: list[str] = (),
            iteration: int = 0) -> tuple[Path, object]:
    """Write a ptdp checkpoint of the layout in `overrides` from an HF model directory.

    Returns (iteration directory, resolved Config)."""
    from ptdp.checkpoint.save import conversion_config, save_full_state

    _quiet_transformers()
    family, config, model_cfg = read_hf_config(hf_dir)
    family = family.for_config(config)
    model_cfg = replace(model_cfg, mtp_layers=prediction_depths(hf_dir, family, config,
                                                                model_cfg.num_layers))
    tokenizer = directory_tokenizer(hf_dir)
    if tokenizer:
        checked_tokenizer(tokenizer, model_cfg.vocab_size)
    cfg = conversion_config(model_cfg, overrides, tokenizer)
    check_model_overrides(model_cfg, cfg.model)
    hf = load_hf_weights(hf_dir, family, config, depth_prefixes(model_cfg))
    hf.update(read_depths(hf_dir, model_cfg))
    state = family.from_hf(model_cfg, hf)
    if "embedding.position" in state:   # a learned table: cut to model.seq_length on request
        state["embedding.position"] = state["embedding.position"][:cfg.model.seq_length]
    return save_full_state(state, cfg, out, iteration=iteration,
                           extra_meta=family.meta_from_hf(model_cfg, hf)), cfg


def check_model_overrides(read: ModelConfig, model: ModelConfig) -> None:
    """Of the model keys, a conversion may set only the sequence length (a learned table is cut
    to it; a rotary model takes any up to its longest position) and the training-only rates
    and coefficient (multi-token prediction's λ); anything else would not be the Hugging Face
    model: one line naming the key."""
    free = ("seq_length", "dropout", "attention_dropout", "init_std", "mtp_loss_scale")
    for field in fields(ModelConfig):
        key, want, got = field.name, getattr(read, field.name), getattr(model, field.name)
        if key not in free and want != got:
            raise ConversionError(f"model.{key}={got}: the Hugging Face model has {want}; a "
                                  f"conversion sets only model.seq_length and the dropout rates")
    if model.position_embedding != "rope":   # (a rotary length is checked with the config)
        require(model.seq_length <= read.seq_length,
                f"model.seq_length={model.seq_length}: the Hugging Face model's position table "
                f"has {read.seq_length} rows")
