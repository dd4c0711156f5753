"""Gemma (`GemmaForCausalLM`, model_type gemma) <-> ptdp's Llama-style GPT with Gemma's options:
  * RMSNorm with the zero-centred gain 1 + w (model.norm_zero_centered; HF's weight is w, so
    the weights copy as they are), computed in fp32 as HF's GemmaRMSNorm;
  * GeGLU (model.activation=geglu: tanh-GeLU(gate) * up; HF's hidden_act "gelu_pytorch_tanh",
    or the legacy "gelu" its config turns into it), gate/up mapped as Llama's;
  * word embeddings times sqrt(hidden_size) (model.scale_embeddings), the head size of its
    config (model.head_dim: 256 for Gemma-7B's 3072 / 16), the output layer tied.
Gemma 2 and 3 are refused, each in one line naming the feature ptdp's block has not:
logit soft-capping (Gemma 2's `final_logit_softcapping` / `attn_logit_softcapping`: tanh
bounds on the logits and on the attention scores) and the sandwich norms of both (an RMSNorm
after attention and after the MLP as well as before: `post_attention_layernorm`,
`post_feedforward_layernorm`); Gemma 3's checkpoints with a vision tower are not text decoders.
"""

from __future__ import annotations

from ptdp.config import ModelConfig
from ptdp.hf.llama import Llama

SANDWICH = ("sandwich norms (post_attention_layernorm and post_feedforward_layernorm: an "
            "RMSNorm after attention and after the MLP too): ptdp's layers normalise only "
            "before each")


def _gemma2(raw: dict) -> str:
    caps = [f"{key}={raw[key]}" for key in ("final_logit_softcapping", "attn_logit_softcapping")
            if raw.get(key)]
    if caps:
        return (f"Gemma 2's {', '.join(caps)} soft-caps (tanh) its logits and attention "
                f"scores, which ptdp's model does not")
    return f"Gemma 2's {SANDWICH}"


# model_type -> (the config.json's contents -> the one-line refusal)
REFUSED = {
    "gemma2": _gemma2,
    "gemma3_text": lambda raw: f"Gemma 3's {SANDWICH}",
    "gemma3": lambda raw: "Gemma 3 (Gemma3ForConditionalGeneration) is a vision-language "
                          "model; ptdp converts text decoders (and its text decoder has "
                          f"{SANDWICH})",
}


class Gemma(Llama):
    model_type, hf_class, config_class = "gemma", "GemmaForCausalLM", "GemmaConfig"
    block = dict(Llama.block, activation="geglu", norm_zero_centered=True, scale_embeddings=True)
    activation = "gelu_pytorch_tanh"

    def model_keys(self, config) -> dict:
        return dict(super().model_keys(config), activation="geglu", norm_zero_centered=True,
                    scale_embeddings=True)

    def hf_extra(self, cfg: ModelConfig) -> dict:
        return dict(head_dim=cfg.head_dim, attention_bias=False)
