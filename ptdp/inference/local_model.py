"""The whole model in one process, from a checkpoint of any layout: for generation, conversion
and tests, not for training.

`read_full_state` rebuilds every parameter's full (layout-free, vocabulary-trimmed) tensor
from the shard files with `ptdp.checkpoint.ShardReader`; no process group is needed. For a
PipeDream-2BW checkpoint the saved `value` is the newest weight version W(N) (the `shadow`
beside it is W(N-1), which only a resumed 2BW run needs), so that is the one taken.

`LocalModel` is a single pipeline stage (p = t = 1) built from the same `models/` code as a
training rank, with the full tensors copied in; `logits` runs the model's own modules.
"""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

import torch

from ptdp.checkpoint.layout import find_checkpoint, read_metadata
from ptdp.checkpoint.reshard import ShardReader
from ptdp.config import ModelConfig, padded_vocab_size
from ptdp.config.models import Heads
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG
from ptdp.parallel.roles import role_of
from ptdp.parallel.sharding import local_slice


def model_config(meta: dict) -> ModelConfig:
    """The ModelConfig a checkpoint's metadata describes (unknown keys ignored)."""
    known = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in meta["model"].items() if k in known})


def read_full_state(path: str | os.PathLike) -> tuple[Path, dict, dict[str, torch.Tensor]]:
    """(iteration directory, metadata, {global name: full fp32 tensor}) of a checkpoint."""
    directory, _ = find_checkpoint(path)
    meta = read_metadata(directory)
    reader = ShardReader(directory, meta)
    state = {name: reader.full(name)["value"].float().clone() for name in meta["params"]}
    return directory, meta, state


def checkpoint_tokenizer(directory: Path, meta: dict, given: str | None = None) -> str | None:
    """The tokenizer of a checkpoint (a sentencepiece .model or a Hugging Face tokenizer.json;
    ptdp/data/tokenizer.py `load_tokenizer` reads either): `given`, else the checkpoint's own
    copy, else its training config's data.tokenizer; None if none exists."""
    from ptdp.checkpoint.layout import TOKENIZER_FILE
    from ptdp.data.tokenizer import HF_TOKENIZER_FILE
    if given:
        if not Path(given).exists():
            raise FileNotFoundError(f"--tokenizer {given}: no such file")
        return str(given)
    for path in (Path(directory) / TOKENIZER_FILE, Path(directory) / HF_TOKENIZER_FILE,
                 meta.get("config", {}).get("data", {}).get("tokenizer")):
        if path and Path(path).exists():
            return str(path)
    return None


def build_single_stage(cfg: ModelConfig, seed: int = 0):
    """One chunk holding the whole model (p = t = 1), on CPU, with its initial weights."""
    from ptdp.models import ModelContext, build_chunk
    tp = TensorParallel()
    ctx = ModelContext(cfg, tp, seed, TensorParallelRNG(seed, 0, torch.device("cpu")),
                       padded_vocab_size(cfg.vocab_size, 1))
    return build_chunk(ctx, 0, 1)


def _trimmed_state(chunk, vocab_size: int) -> dict[str, torch.Tensor]:
    from ptdp.models import named_global_parameters
    return {name: (p[:vocab_size] if role_of(p).vocab_padded else p).detach().float().clone()
            for name, p in named_global_parameters(chunk)}


def initial_state(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The full weights a run with train.seed=seed starts from (any layout: ptdp initialises
    every parameter from its full tensor's own stream)."""
    return _trimmed_state(build_single_stage(cfg, seed), cfg.vocab_size)


class LocalModel(torch.nn.Module):
    """The whole GPT or BERT in one process; weights from a full state dict."""

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor]):
        super().__init__()
        from ptdp.models import named_global_parameters
        self.cfg = cfg
        self.chunk = build_single_stage(cfg)
        padded = padded_vocab_size(cfg.vocab_size, 1)
        names = dict(named_global_parameters(self.chunk))
        missing = sorted(set(names) - set(state))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise KeyError(f"the weights have no '{missing[0]}'{more}")
        with torch.no_grad():
            for name, param in names.items():
                full = local_slice(param, state[name].to(param.dtype), TensorParallel(), padded)
                if full.shape != param.shape:
                    raise ValueError(f"'{name}': shape {list(state[name].shape)} does not fit "
                                     f"the model's {list(param.shape)}")
                param.copy_(full)
        self.eval()

    def full_state(self) -> dict[str, torch.Tensor]:
        """{global name: full tensor}, vocabulary padding trimmed (what checkpoints hold)."""
        return _trimmed_state(self.chunk, self.cfg.vocab_size)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike) -> "LocalModel":
        _, meta, state = read_full_state(path)
        model = cls(model_config(meta), state)
        model.set_expert_biases((meta.get("moe") or {}).get("expert_bias", {}))
        return model

    def set_expert_biases(self, biases: dict) -> None:
        """The routers' selection biases ({global MoE layer: [E]}, the checkpoint's "moe" part,
        ptdp/training/experts.py), so that they pick experts as the trained model does."""
        from ptdp.models.moe import routers_by_layer
        for layer, router in routers_by_layer(self.chunk).items():
            if str(layer) in biases:
                router.expert_bias = torch.tensor(biases[str(layer)], dtype=torch.float32)

    def hidden(self, tokens: torch.Tensor, types=None, padding_mask=None) -> torch.Tensor:
        """[b, s] token ids -> final-LayerNorm hidden states [s, b, h]."""
        chunk = self.chunk
        mask = chunk.attention_mask(tokens.shape[1], tokens.device, padding=padding_mask)
        return chunk.final_ln(chunk.stack(chunk.embedding(tokens, types), mask))

    def logits(self, tokens: torch.Tensor, types=None, padding_mask=None) -> torch.Tensor:
        """[b, s] -> [b, s, vocab_size] (GPT: next-token; BERT: masked-LM) logits, fp32."""
        from ptdp.models.embedding import logits
        chunk, v = self.chunk, self.cfg.vocab_size
        h = self.hidden(tokens, types, padding_mask)
        if self.cfg.family.heads is Heads.BERT:   # the masked-LM transform before the logits
            heads = chunk.heads
            lm = heads.lm_ln(torch.nn.functional.gelu(heads.lm_dense(h)))
            out = logits(lm, chunk.output_table(), chunk.ctx, heads.lm_bias)
        else:
            out = logits(h, chunk.output_table(), chunk.ctx)
        return out[..., :v].transpose(0, 1).float()

    def sentence_order_logits(self, tokens, types, padding_mask) -> torch.Tensor:
        """BERT's binary head on [CLS]: [b, 2] (index 1 = segments swapped)."""
        heads = self.chunk.heads
        h = self.hidden(tokens, types, padding_mask)
        return heads.binary(torch.tanh(heads.pooler(h[0]))).float()
