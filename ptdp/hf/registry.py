"""The Hugging Face families ptdp converts, by transformers `model_type`, and the family a ptdp
model converts to (chosen from its block options)."""

from __future__ import annotations

from ptdp.config import ModelConfig
from ptdp.hf.base import ConversionError, Family
from ptdp.hf.deepseek import DeepseekV3
from ptdp.hf.gemma import Gemma
from ptdp.hf.gpt2 import GPT2
from ptdp.hf.llama import Llama, Mistral, Qwen2, Qwen3
from ptdp.hf.megatron_bert import MegatronBert
from ptdp.hf.moe import Mixtral, Qwen2Moe, Qwen3Moe
from ptdp.hf.phi3 import Phi3

FAMILIES: dict[str, Family] = {f.model_type: f for f in
                               (GPT2(), MegatronBert(), Llama(), Mistral(), Qwen2(), Qwen3(),
                                Gemma(), Phi3(), Mixtral(), Qwen2Moe(), Qwen3Moe(),
                                DeepseekV3())}
# ptdp -> HF: the first family that computes the model (BERT first: its block is GPT-2's;
# Llama before Mistral: a model without a window is written as Llama). Phi-3 computes Llama's
# block too: it is written only when asked for (`ptdp convert --to hf OUT --model-type phi3`).
TARGETS = ("megatron-bert", "gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "mixtral",
           "qwen2_moe", "qwen3_moe", "deepseek_v3")


def family_of_model_type(model_type) -> Family:
    """The family of a transformers config.json's model_type, or a one-line refusal."""
    if model_type not in FAMILIES:
        raise ConversionError(f"model_type {model_type!r} is not one ptdp converts: "
                              f"{', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def family_of(cfg: ModelConfig, model_type: str | None = None) -> Family:
    """The family whose HF class computes ptdp's model `cfg` (`model_type`'s, when given), or
    a one-line refusal naming what keeps it from GPT-2's block and from Llama's."""
    if model_type is not None:
        family = family_of_model_type(model_type)
        if family.mismatches(cfg):
            raise ConversionError(f"model_type {model_type} ({family.hf_class}) does not compute "
                                  f"this model: it needs {', '.join(family.mismatches(cfg))}")
        return family
    for name in TARGETS:
        if not FAMILIES[name].mismatches(cfg):
            return FAMILIES[name]
    if cfg.latent_attention:   # only DeepSeek's class has it: say what that one needs
        deepseek = FAMILIES["deepseek_v3"]
        raise ConversionError(f"no Hugging Face class computes this model: {deepseek.hf_class} "
                              f"needs {', '.join(deepseek.mismatches(cfg))}")
    gpt2, llama = FAMILIES["gpt2"], FAMILIES["llama"]
    llama_needs = [m for m in llama.mismatches(cfg) if not m.startswith("model.qkv_bias=")]
    raise ConversionError(
        f"no Hugging Face class computes this model: {gpt2.hf_class} needs "
        f"{', '.join(gpt2.mismatches(cfg))}; {llama.hf_class} (or Qwen2ForCausalLM, with "
        f"model.qkv_bias=true) needs {', '.join(llama_needs)}")
