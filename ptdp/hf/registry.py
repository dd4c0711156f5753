"""The Hugging Face families ptdp converts, by transformers `model_type`, and the family a ptdp
model converts to (chosen from its block options)."""

from __future__ import annotations

from ptdp.config import ModelConfig
from ptdp.hf.base import ConversionError, Family
from ptdp.hf.gpt2 import GPT2
from ptdp.hf.llama import Llama, Mistral, Qwen2
from ptdp.hf.megatron_bert import MegatronBert

FAMILIES: dict[str, Family] = {f.model_type: f for f in
                               (GPT2(), MegatronBert(), Llama(), Mistral(), Qwen2())}
# ptdp -> HF: the first family that computes the model (BERT first: its block is GPT-2's;
# Mistral's block is Llama's, and Llama is what is written).
TARGETS = ("megatron-bert", "gpt2", "llama", "qwen2")


def family_of_model_type(model_type) -> Family:
    """The family of a transformers config.json's model_type, or a one-line refusal."""
    if model_type not in FAMILIES:
        raise ConversionError(f"model_type {model_type!r} is not one ptdp converts: "
                              f"{', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def family_of(cfg: ModelConfig) -> Family:
    """The family whose HF class computes ptdp's model `cfg`, or a one-line refusal naming
    what keeps it from GPT-2's block and from Llama's."""
    if cfg.num_experts:
        raise ConversionError(f"model.num_experts={cfg.num_experts}: ptdp does not convert "
                              f"mixtures of experts to Hugging Face yet (docs/moe.md)")
    for name in TARGETS:
        if not FAMILIES[name].mismatches(cfg):
            return FAMILIES[name]
    gpt2, llama = FAMILIES["gpt2"], FAMILIES["llama"]
    llama_needs = [m for m in llama.mismatches(cfg) if not m.startswith("model.qkv_bias=")]
    raise ConversionError(
        f"no Hugging Face class computes this model: {gpt2.hf_class} needs "
        f"{', '.join(gpt2.mismatches(cfg))}; {llama.hf_class} (or Qwen2ForCausalLM, with "
        f"model.qkv_bias=true) needs {', '.join(llama_needs)}")
