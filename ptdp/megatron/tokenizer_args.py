"""The tokenizer arguments of a Megatron-LM checkpoint ptdp writes: `tokenizer_type` and the
file arguments Megatron-LM's `build_tokenizer` (megatron/training/tokenizer/tokenizer.py)
reads for it, from the tokenizer a ptdp checkpoint was trained with.

Megatron-LM saves every argument in a checkpoint, and its `check_checkpoint_args` compares
`tokenizer_type` with the run's whenever the run gives `--vocab-file`: a checkpoint without
it fails to load (AttributeError). Each ptdp tokenizer kind (ptdp/data/tokenizer.py) maps to
the Megatron tokenizer that reads the same file:

  GPT-2 vocab.json (+ merges)   GPT2BPETokenizer            --vocab-file, --merge-file
  WordPiece vocab.txt           BertWordPiece(LowerCase|Case) --vocab-file
  Hugging Face tokenizer.json   HuggingFaceTokenizer        --tokenizer-model (its folder)
  sentencepiece .model          GPTSentencePieceTokenizer   --tokenizer-model
  none (token ids, synthetic)   NullTokenizer               --vocab-size (V - 1: it adds <eod>)
"""

from __future__ import annotations

from pathlib import Path

# Megatron-LM's argument names, each None unless the kind sets it.
FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size",
          "vocab_extra_ids", "tiktoken_pattern")


def tokenizer_args(path: str | None, vocab_size: int) -> dict:
    """{Megatron argument: value} for the tokenizer at `path` (None: no tokenizer) of a model
    whose vocabulary has `vocab_size` rows."""
    out = dict.fromkeys(FIELDS)
    out["vocab_extra_ids"] = 0
    if path is None:
        # NullTokenizer's vocabulary is --vocab-size ids plus its end-of-document id
        return dict(out, tokenizer_type="NullTokenizer", vocab_size=vocab_size - 1)
    from ptdp.data import vocab_tokenizers
    from ptdp.data.tokenizer import is_hf_tokenizer
    path = Path(path).resolve()
    found = vocab_tokenizers.vocab_files(path)
    if found is not None:
        kind, vocab = found
        if kind == vocab_tokenizers.GPT2:
            merges = vocab_tokenizers.merges_beside(vocab)
            return dict(out, tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab),
                        merge_file=None if merges is None else str(merges))
        lower = vocab_tokenizers.wordpiece_lowercase(vocab)
        return dict(out, tokenizer_type="BertWordPieceLowerCase" if lower else
                    "BertWordPieceCase", vocab_file=str(vocab))
    if is_hf_tokenizer(path):   # AutoTokenizer.from_pretrained reads the folder
        folder = path if path.is_dir() else path.parent
        return dict(out, tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(folder))
    return dict(out, tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=str(path))
