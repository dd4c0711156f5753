"""`ptdp convert`: a ptdp checkpoint of any layout <-> a Hugging Face model directory.

ptdp -> HF: the full weights (ptdp/inference/local_model.py reads any (p, t, d, v), 2BW included),
mapped by ptdp/hf/mapping.py into `GPT2LMHeadModel` or `MegatronBertForPreTraining`, saved
with `save_pretrained` (model.safetensors + config.json), plus the tokenizer as tokenizer.json
(ptdp/hf/tokenizer.py) and the original sentencepiece file as `ptdp_tokenizer.model`, which
the way back copies into the checkpoint.

HF -> ptdp: the model directory's weights mapped back and written as a checkpoint of the
layout the overrides ask for (ptdp/checkpoint/save.py `save_full_state`); `ptdp train ...
checkpoint.load=OUT` continues from it (with fresh optimizer state).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ptdp.hf.mapping import (from_hf_state, hf_class_name, hf_config, model_config_from_hf,
                             to_hf_state)
from ptdp.inference.local_model import checkpoint_tokenizer, model_config, read_full_state

SPM_FILE = "ptdp_tokenizer.model"


def _quiet_transformers():
    """No per-file progress bars from save_pretrained / from_pretrained."""
    from transformers.utils import logging
    logging.disable_progress_bar()


def to_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
          tokenizer: str | None = None) -> dict:
    """Write the HF model (and tokenizer, when known) to out_dir; returns a short summary."""
    import transformers
    from ptdp.data.tokenizer import Tokenizer
    from ptdp.hf.tokenizer import save_hf_tokenizer

    _quiet_transformers()
    directory, meta, state = read_full_state(checkpoint)
    cfg = model_config(meta)
    spm = checkpoint_tokenizer(directory, meta, tokenizer)
    special = {}
    if spm:
        tok = Tokenizer(spm)
        if tok.vocab_size != cfg.vocab_size:
            raise ValueError(f"tokenizer {spm} has {tok.vocab_size} tokens but the model's "
                             f"vocabulary is model.vocab_size={cfg.vocab_size}")
        special = tok.special_ids()
    config = hf_config(cfg, special)
    config.ptdp = {"checkpoint": str(directory), "iteration": meta["iteration"]}
    model = getattr(transformers, hf_class_name(cfg.arch))(config)
    model.load_state_dict(to_hf_state(cfg, state), strict=True)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    if spm:
        save_hf_tokenizer(spm, out, cfg.arch, cfg.seq_length)
        shutil.copyfile(spm, out / SPM_FILE)
    return {"class": hf_class_name(cfg.arch), "checkpoint": str(directory),
            "iteration": meta["iteration"], "tokenizer": spm,
            "parameters": sum(p.numel() for p in model.parameters())}


def from_hf(hf_dir: str | os.PathLike, out: str | os.PathLike, overrides: list[str] = (),
            iteration: int = 0) -> tuple[Path, object]:
    """Write a ptdp checkpoint of the layout in `overrides` from an HF model directory.

    Returns (iteration directory, resolved Config)."""
    import transformers
    from ptdp.checkpoint.save import save_full_state
    from ptdp.config import load_config

    _quiet_transformers()
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json: not a Hugging Face model directory")
    config = transformers.AutoConfig.from_pretrained(str(hf_dir))
    model_cfg = model_config_from_hf(config)
    model_keys = [f"model.{k}={json.dumps(v)}" for k, v in vars(model_cfg).items()]
    par = {"tensor": 1, "pipeline": 1, "data": 1, "chunks": 1}
    for item in overrides:
        key, _, value = item.partition("=")
        if key.startswith("parallel.") and key[len("parallel."):] in par and value.isdigit():
            par[key[len("parallel."):]] = int(value)
    world = par["tensor"] * par["pipeline"] * par["data"]
    extra = ["data.source=synthetic"] if not any(o.startswith("data.") for o in overrides) else []
    cfg = load_config(None, model_keys + extra + list(overrides), world_size=world)
    model = getattr(transformers, hf_class_name(model_cfg.arch)).from_pretrained(str(hf_dir))
    state = from_hf_state(model_cfg, model.state_dict())
    spm = hf_dir / SPM_FILE
    final = save_full_state(state, cfg, out, iteration=iteration,
                            tokenizer=spm if spm.is_file() else None)
    return final, cfg
