"""Phi-3 (`Phi3ForCausalLM`, model_type phi3) <-> ptdp's Llama-style GPT.

Mistral's block (ptdp/hf/llama.py: Llama's, with a window in every layer or none) with two
fused projections, split on the way in and fused again on the way out:
  * `qkv_proj`: the rows of q_proj, k_proj and v_proj stacked ([q heads | k heads | v heads]);
    ptdp's fused QKV groups them by K/V head instead (ptdp/hf/base.py `split_qkv`).
  * `gate_up_proj`: gate_proj's rows then up_proj's; ptdp's fc1 alternates them.
Its residual dropout (resid_pdrop) is model.dropout, and its sliding_window (Phi-3-mini-4k's
2047) model.sliding_window. Refused by the rotary settings: `longrope` scaling (Phi-3's 128k
models) and a partial rotary factor (Phi-4-mini), in one line each. ptdp -> HF writes Llama
(or Mistral, with a window) unless `ptdp convert --to hf OUT --model-type phi3` asks for this.
"""

from __future__ import annotations

import torch

from ptdp.config import ModelConfig
from ptdp.hf.base import fc1_of_gate_then_up, gate_then_up, require
from ptdp.hf.llama import Llama, Mistral


class Phi3(Mistral):
    """Mistral's block (a window in every layer or none) and config, with the fused projections
    and one dropout rate."""
    model_type, hf_class, config_class = "phi3", "Phi3ForCausalLM", "Phi3Config"

    def refuse(self, config) -> None:
        super().refuse(config)
        require(getattr(config, "embd_pdrop", 0.0) in (0, getattr(config, "resid_pdrop", 0.0)),
                f"embd_pdrop={config.embd_pdrop} differs from resid_pdrop: ptdp's model.dropout "
                f"is one rate")

    def model_keys(self, config) -> dict:
        return dict(super().model_keys(config), dropout=float(config.resid_pdrop))

    def hf_extra(self, cfg: ModelConfig) -> dict:
        return dict(super().hf_extra(cfg), resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout)

    @staticmethod
    def attention_to_hf(cfg, full, ours: str, theirs: str, out: dict) -> None:
        parts = {}
        Llama.attention_to_hf(cfg, full, ours, "", parts)
        out[f"{theirs}qkv_proj.weight"] = torch.cat(
            [parts[f"{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])

    @staticmethod
    def attention_from_hf(cfg, get, ours: str, theirs: str, out: dict) -> None:
        d, n, g = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q, k, v = get(f"{theirs}qkv_proj.weight").split([n * d, g * d, g * d])
        parts = {f"{p}.weight": w for p, w in zip(("q_proj", "k_proj", "v_proj"), (q, k, v))}
        Llama.attention_from_hf(cfg, parts.__getitem__, ours, "", out)

    @staticmethod
    def mlp_to_hf(cfg, layer: int, full, ours: str, theirs: str, out: dict) -> None:
        out[f"{theirs}gate_up_proj.weight"] = gate_then_up(full[f"{ours}fc1.weight"])
        out[f"{theirs}down_proj.weight"] = full[f"{ours}fc2.weight"]

    @staticmethod
    def mlp_from_hf(cfg, layer: int, get, ours: str, theirs: str, out: dict) -> None:
        out[f"{ours}fc1.weight"] = fc1_of_gate_then_up(get(f"{theirs}gate_up_proj.weight"))
        out[f"{ours}fc2.weight"] = get(f"{theirs}down_proj.weight").contiguous()
