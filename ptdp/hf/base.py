"""What every Hugging Face model family shares: the refusal error, the family interface (a
config mapping plus a state-dict adapter, torchtitan's pattern) and the fused-QKV layouts.

A family (ptdp/hf/gpt2.py, llama.py, ...) maps one transformers `model_type`:
  * `model_config(config)`: the transformers config -> ptdp's ModelConfig, refusing (one
    `ConversionError` line naming the setting) anything ptdp's model would compute differently;
  * `hf_config(cfg, special)`: ptdp's ModelConfig -> a transformers config;
  * `model_family`: the ptdp model family it converts (ptdp/config/models.py), and `block`:
    the ptdp block options the HF class computes (ptdp -> HF picks the family whose family and
    block the model has; ptdp/hf/registry.py);
  * `to_hf(cfg, full)` / `from_hf(cfg, hf)`: full (layout-free) state dicts both ways.
"""

from __future__ import annotations

import torch

from ptdp.config import ModelConfig
from ptdp.config.models import ModelFamily
from ptdp.models.transformer import fuse_gate_up, split_gate_up


# The model.seq_length a rotary model converted from Hugging Face trains at unless told
# (`ptdp convert ... model.seq_length=N`): its max_position_embeddings (131,072 for Llama 3.1)
# is what it supports, not a sensible training length.
DEFAULT_SEQ_LENGTH = 4096


def rotary_lengths(max_position_embeddings: int) -> dict:
    """The model keys of a rotary model that supports `max_position_embeddings` positions."""
    return dict(seq_length=min(max_position_embeddings, DEFAULT_SEQ_LENGTH),
                max_position_embeddings=max_position_embeddings)


class ConversionError(ValueError):
    """A model, config or file that cannot be converted faithfully; one line naming why."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConversionError(message)


class Family:
    """One transformers model type (subclasses fill in the names and the four mappings)."""

    model_type: str = ""
    hf_class: str = ""
    config_class: str = ""
    model_family: ModelFamily
    latent_attention = False   # the HF class's attention is DeepSeek's latent attention

    def for_config(self, config) -> "Family":
        """This family reading the weights of the transformers `config` (a family whose weight
        layout depends on the config returns a copy that knows it)."""
        return self

    def meta_from_hf(self, cfg: ModelConfig, hf: dict) -> dict | None:
        """State a ptdp checkpoint keeps in its metadata, from the HF weights (none)."""
        return None

    def meta_to_hf(self, cfg: ModelConfig, meta: dict, out: dict) -> None:
        """Add to the HF weights `out` what the checkpoint's metadata `meta` holds (nothing)."""
    block: dict = {}

    def mismatches(self, cfg: ModelConfig) -> list[str]:
        """What of `cfg` this family's HF class cannot compute: another model family, as
        'model.arch=WANTED', then the block options, as 'model.KEY=WANTED (not GOT)'."""
        ours = self.model_family
        family = [] if cfg.family is ours else [f"model.arch={ours.name}"]
        latent = ([] if cfg.latent_attention == self.latent_attention else
                  [f"model.mla_kv_lora_rank {'> 0' if self.latent_attention else '= 0'} (not "
                   f"{cfg.mla_kv_lora_rank})"])
        return family + latent + [f"model.{key}={_text(want)} (not {_text(getattr(cfg, key))})"
                                  for key, want in self.block.items()
                                  if not _fits(getattr(cfg, key), want)]

    def model_config(self, config) -> ModelConfig:
        raise NotImplementedError

    def hf_config(self, cfg: ModelConfig, special: dict[str, int]):
        raise NotImplementedError

    def to_hf(self, cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def from_hf(self, cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @staticmethod
    def _pairs(cfg: ModelConfig):
        """(ptdp name, HF name, transposed) of the weights that only change name."""
        raise NotImplementedError

    def renamed_to_hf(self, cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict:
        """The weights that only change name, under HF's names."""
        return renamed(self._pairs(cfg), full)

    def renamed_from_hf(self, cfg: ModelConfig, hf: dict[str, torch.Tensor]):
        """(the weights that only change name, under ptdp's names; a getter of the HF weights
        that names a missing one)."""
        get = getter(hf)
        return renamed(((hf_name, ours, t) for ours, hf_name, t in self._pairs(cfg)), hf, get), get


# The block options a plain decoder leaves off: a family that computes one says so in its block.
PLAIN = dict(sliding_window=None, num_experts=0, norm_zero_centered=False, qk_norm=False,
             scale_embeddings=False)


class OneOf(tuple):
    """A block option the HF class computes for any of these values."""


class Set:
    """A block option the HF class computes for any value but `off` (a MoE class: experts)."""

    def __init__(self, off=None):
        self.off = off

    def __str__(self) -> str:
        return f"any but {_text(self.off)}"


def _fits(value, want) -> bool:
    if isinstance(want, OneOf):
        return value in want
    if isinstance(want, Set):
        return value != want.off
    return value == want


def _text(value) -> str:
    if isinstance(value, OneOf):
        return "|".join(_text(v) for v in value)
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def getter(hf: dict[str, torch.Tensor]):
    """hf[name] as fp32, or a one-line error naming the missing weight."""
    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise ConversionError(f"the Hugging Face weights have no '{name}'")
        return hf[name].float()
    return get


def renamed(pairs, source: dict[str, torch.Tensor], get=None) -> dict[str, torch.Tensor]:
    """{to: source[from] (transposed when asked)} for (from, to, transposed) in pairs."""
    get = get or source.__getitem__
    out = {}
    for src, dst, transposed in pairs:
        value = get(src)
        out[dst] = (value.t() if transposed else value).contiguous()
    return out


# --------------------------------------------------------------------------------------------
# Fused QKV: ptdp's rows are grouped by K/V head, [group j, (q heads j*r .. j*r+r-1, k_j, v_j),
# head_dim] (r = heads / kv_heads; with r = 1 that is GPT's [head, (q, k, v), head_dim]), so a
# tensor rank owns whole groups. Hugging Face keeps q, k and v apart, each [head, head_dim].
# --------------------------------------------------------------------------------------------

def split_qkv(w: torch.Tensor, heads: int, kv_heads: int):
    """ptdp's fused QKV weight or bias -> (q, k, v) in head order (any trailing dims)."""
    r, rest = heads // kv_heads, w.shape[1:]
    blocks = w.reshape(kv_heads, r + 2, -1, *rest)
    return tuple(part.reshape(-1, *rest).contiguous()
                 for part in (blocks[:, :r], blocks[:, r], blocks[:, r + 1]))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
             kv_heads: int) -> torch.Tensor:
    """The inverse of `split_qkv`."""
    r, rest, d = heads // kv_heads, q.shape[1:], q.shape[0] // heads
    blocks = torch.cat([q.reshape(kv_heads, r, d, *rest), k.reshape(kv_heads, 1, d, *rest),
                        v.reshape(kv_heads, 1, d, *rest)], dim=1)
    return blocks.reshape(-1, *rest).contiguous()


# SwiGLU's fc1: ptdp's rows alternate gate and up (models/transformer.py `fuse_gate_up`); the
# fused HF projections (Phi-3's gate_up_proj, transformers 5's stacked experts) hold every gate
# row, then every up row.
def gate_then_up(fc1: torch.Tensor) -> torch.Tensor:
    """ptdp's fc1 -> [gate rows; up rows]."""
    return torch.cat(split_gate_up(fc1))


def fc1_of_gate_then_up(gate_up: torch.Tensor) -> torch.Tensor:
    """The inverse of `gate_then_up`."""
    return fuse_gate_up(*gate_up.chunk(2))
