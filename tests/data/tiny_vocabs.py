"""Tiny GPT-2 BPE (vocab.json + merges.txt) and WordPiece (vocab.txt) vocabularies, trained in
a few milliseconds by the `tokenizers` library: Megatron-style tokenizer files without a
download. Without `tokenizers` (an optional extra) the test asking for them skips."""

from __future__ import annotations

from pathlib import Path

from tests.optional import needs

TEXTS = ["Hello world! The quick brown fox jumps over the lazy dog.",
         "Ünïcödé  text,   with  spaces\n\nand two lines. Another sentence here.",
         "def f(x):\n    return x + 1  # a comment about [MASK] and <|endoftext|>"]


def write_gpt2_files(directory: Path) -> tuple[Path, Path]:
    """gpt2-vocab.json and gpt2-merges.txt (Megatron's names), <|endoftext|> included."""
    needs("tokenizers")
    from tokenizers.implementations import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS * 10, vocab_size=300, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(directory), "gpt2")
    return directory / "gpt2-vocab.json", directory / "gpt2-merges.txt"


def write_wordpiece_vocab(directory: Path) -> Path:
    """An uncased BERT vocab.txt with [PAD] [UNK] [CLS] [SEP] [MASK]."""
    needs("tokenizers")
    from tokenizers.implementations import BertWordPieceTokenizer

    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(TEXTS * 10, vocab_size=200, min_frequency=1, show_progress=False)
    wp.save_model(str(directory))
    return directory / "vocab.txt"
