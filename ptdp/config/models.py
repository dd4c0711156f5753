"""The model catalogue: every model family `model.arch` can name, with its traits, and the block
presets `model.preset` can name.

One table, read by config validation, `ptdp check`, the planner, data building, the trainer,
metrics, generation and the Hugging Face and Megatron conversions; code asks a family what it
does (`family.causal`, `family.samples`, `family.losses`, `family.heads`, ...) instead of
comparing its name, as it asks the schedule catalogue (ptdp/config/catalogue.py) about
schedules. Torch-free and import-free, so every floor of the house can read it. The networks
themselves are in models/ (`build_chunk` binds each family to its chunk class).

A family is what changes the data, the loss and the heads: GPT (a causal decoder trained on
documents) and BERT (a bidirectional encoder trained on sentence pairs). A Llama-style decoder
is not a family but a *preset* of GPT's block options (rotary positions, RMSNorm, SwiGLU, ...):
the same chunk, data, loss and formulas (generalised to any block).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

from ptdp.config.hints import suggest


class Samples(enum.Enum):
    """What a family's micro-batches hold: the dataset kind ptdp/data/build.py picks. The value
    names the kind in the index caches' file names and keys (ptdp/data/index_cache.py)."""
    # Windows of seq+1 tokens over concatenated documents, each token predicting the next
    # (GPTDataset, SyntheticGPT); Megatron's sample order and the <eod> options act on them.
    DOCUMENTS = "gpt"
    # [CLS] A [SEP] B [SEP] from a document's sentences, tokens masked, a sentence-order label
    # (BertDataset, SyntheticBERT): the data needs sentence boundaries and [CLS], [SEP], [MASK].
    SENTENCE_PAIRS = "bert"


class Heads(enum.Enum):
    """What the last stage computes after the final norm (models/), as the planner's formulas
    (ptdp/planner/formulas.py) count it and the conversions name it."""
    # The output layer (tied to the word table or not) and the loss over its logits: Eq. 4.2
    # and 4.3, generalised to any block.
    LOGITS = "logits"
    # Megatron-BERT's: the masked-LM transform (dense, GeLU, LayerNorm) before the tied logits
    # with a vocabulary bias, the [CLS] pooler and the binary sentence-order head
    # (bert_flops_per_iteration, bert_parameter_count).
    BERT = "bert heads"


@dataclass(frozen=True)
class ModelFamily:
    name: str
    causal: bool                # attention sees only earlier positions (ring attention needs it)
    samples: Samples            # what its batches hold
    heads: Heads                # what the last stage computes, and which formulas count it
    losses: tuple[str, ...]     # the chunk's auxiliary losses (its `aux` dict), averaged per step
    logged_losses: tuple[str, ...] = ()  # of those, what each metrics record logs beside `loss`
    token_types: bool = False   # embeds a segment id per token (model.num_tokentypes)
    block_options: bool = True  # model.preset and the block options choose its block; False:
                                # always the default preset's (GPT-2's) block
    generates: bool = False     # `ptdp generate` continues a prompt with it


# GPT: a pre-norm causal decoder; its block is GPT-2's or any preset's (Llama-style).
GPT = ModelFamily("gpt", causal=True, samples=Samples.DOCUMENTS, heads=Heads.LOGITS,
                  losses=("lm_loss",), generates=True)
# BERT: Megatron-BERT, a pre-norm bidirectional encoder whose loss adds the masked-LM and the
# sentence-order losses (both logged).
BERT = ModelFamily("bert", causal=False, samples=Samples.SENTENCE_PAIRS, heads=Heads.BERT,
                   losses=("lm_loss", "sop_loss"), logged_losses=("lm_loss", "sop_loss"),
                   token_types=True, block_options=False)

MODEL_FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (GPT, BERT)}
FAMILY_NAMES: tuple[str, ...] = tuple(MODEL_FAMILIES)
DEFAULT_FAMILY = GPT


def model_family(name: str) -> ModelFamily:
    """The family `model.arch` = `name` names; ValueError naming the choices for an unknown one."""
    family = MODEL_FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown model.arch {name!r}; expected one of "
                         f"{', '.join(FAMILY_NAMES)}{suggest(name, FAMILY_NAMES)}")
    return family


def family_names(predicate: Callable[[ModelFamily], bool]) -> str:
    """The names of the families whose traits satisfy `predicate`, for messages: 'gpt',
    'gpt or bert', 'a, b or c'."""
    names = [name for name, family in MODEL_FAMILIES.items() if predicate(family)]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


# Block presets: what `model.preset` fills in for every block option left unset (null).
# GPT-2's block (the dissertation's, and Megatron-BERT's), and the Llama-style decoder
# (Touvron et al. 2023): rotary positions, RMSNorm, SwiGLU, bias-free linears, untied input and
# output embeddings.
GPT2_BLOCK = "gpt"
LLAMA_BLOCK = "llama"
PRESETS = {
    GPT2_BLOCK: dict(position_embedding="learned", normalization="layernorm", activation="gelu",
                     bias=True, tie_embeddings=True),
    LLAMA_BLOCK: dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu",
                      bias=False, tie_embeddings=False),
}
DEFAULT_PRESET = GPT2_BLOCK
BLOCK_OPTIONS = tuple(PRESETS[DEFAULT_PRESET])

# Block options no preset sets, with the value that leaves them off (a family without block
# options keeps them so; validation names any that is not).
EXTRA_BLOCK_OPTIONS = dict(norm_zero_centered=False, qk_norm=False, scale_embeddings=False)

# The MLP activations model.activation can name (ptdp/kernels/fused.py ACTIVATIONS): GeLU exact
# (erf) or tanh-approximate (GPT-2's gelu_new, Megatron's fused bias-GeLU), and the gated ones,
# SwiGLU (Llama) and GeGLU (Gemma: the tanh GeLU of the gate): fc1 makes a gate and an up
# projection, its rows alternating (models/transformer.py).
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "geglu")
GATED_ACTIVATIONS = ("swiglu", "geglu")
