"""Tiny Hugging Face models and tokenizers for the conversion tests, built from config classes
(no hub): random weights spread wide enough that a wrong mapping shows in the logits."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.optional import needs

needs("transformers")   # the tests/hf modules importing this one skip without it too

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def hf_tokenizer(texts, out_dir: Path, vocab: int, add_bos: bool = False,
                 chat_template: str | None = None) -> Path:
    """A byte-level BPE fast tokenizer trained on `texts`, saved as tokenizer.json and
    tokenizer_config.json (bos and eos named) in out_dir; returns the tokenizer.json path.
    `add_bos`: its post-processor starts every text with BOS (Llama 3's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return Path(out_dir) / "tokenizer.json"


def random_hf_model(config, out_dir: Path | None = None, seed: int = 0, std: float = 0.1):
    """A causal LM of `config` with weights ~ N(0, std) (norm gains 1 + N(0, 0.1): Gemma's
    weight w ~ N(0, 0.1), its gain being 1 + w), in eval mode, saved to out_dir when given."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    centre = 0.0 if config.model_type == "gemma" else 1.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                param.copy_(centre + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, std)
    if out_dir is not None:
        model.save_pretrained(str(out_dir))
    return model


def logits_diff(ours, hf, vocab: int, seq: int, seed: int = 1) -> float:
    """max |ptdp LocalModel logits - HF logits| on random tokens."""
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (ours.logits(tokens) - hf(tokens).logits).abs().max().item()


def same_state(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# Tiny models shaped like released ones (their activation, window, heads, biases, experts, rope
# base, tying), each with 4 layers and 4 query / 2 K/V heads so that (p, t) = (2, 2) splits them.
_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)


def released_configs() -> dict:
    """{family: its transformers config}: GPT-2 as released (gelu_new, tied), Mistral v0.1 (a
    window in every layer), Qwen2 with use_sliding_window (the upper layers local), Phi-3-mini
    (fused projections, a window), Qwen3 (QK-norm, head_dim != h / n, tied), Gemma-7B (GeGLU,
    1 + w norms, scaled embeddings, head_dim != h / n, as many K/V heads as heads), Mixtral
    (8 experts, top 2), Qwen3-MoE (renormalised top-k, QK-norm), Qwen1.5-MoE (a gated shared expert, top-k
    weights not renormalised, every second layer a mixture)."""
    import transformers as t
    tiny = dict(_TINY)
    return {
        "gpt2": t.GPT2Config(vocab_size=128, n_embd=32, n_layer=4, n_head=4, n_positions=64,
                             activation_function="gelu_new", bos_token_id=None,
                             eos_token_id=None),
        "mistral": t.MistralConfig(**tiny, sliding_window=6, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False),
        "qwen2": t.Qwen2Config(**tiny, use_sliding_window=True, sliding_window=5,
                               max_window_layers=2, tie_word_embeddings=True),
        "phi3": t.Phi3Config(**tiny, sliding_window=7, tie_word_embeddings=False),
        "mixtral": t.MixtralConfig(**tiny, num_local_experts=8, num_experts_per_tok=2,
                                   sliding_window=None, rope_parameters={
                                       "rope_type": "default", "rope_theta": 1e6}),
        "qwen3": t.Qwen3Config(**tiny, head_dim=12, tie_word_embeddings=True),
        "gemma": t.GemmaConfig(**{**tiny, "num_key_value_heads": 4}, head_dim=16,
                               hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6),
        "qwen3_moe": t.Qwen3MoeConfig(**tiny, head_dim=12, num_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=16, norm_topk_prob=True),
        "qwen2_moe": t.Qwen2MoeConfig(**{**tiny, "intermediate_size": 40}, num_experts=6,
                                      num_experts_per_tok=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=24, norm_topk_prob=False,
                                      decoder_sparse_step=2),
    }


# the transformers model_type `ptdp convert --to hf` is asked for (else the block picks it)
MODEL_TYPE = {"phi3": "phi3"}
