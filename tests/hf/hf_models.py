"""Tiny Hugging Face models and tokenizers for the conversion tests, built from config classes
(no hub): random weights spread wide enough that a wrong mapping shows in the logits."""

from __future__ import annotations

from pathlib import Path

import torch

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


def random_hf_model(config, out_dir: Path | None = None, seed: int = 0):
    """A causal LM of `config` with weights ~ N(0, 0.1) (norm gains 1 + N(0, 0.1)), in eval
    mode, saved to out_dir when given."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
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
