"""`ptdp tokenizer train` and `ptdp preprocess`: thin argparse wrappers.

sentencepiece, datasets and tqdm are imported inside the commands, so registering these
parsers costs nothing for `ptdp --help` or `ptdp train`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _fail(err: Exception) -> int:
    """Bad input (a file, a field, a tokenizer): one line, and exit 2 as every ptdp command's
    configuration and data errors (a restart loop never retries them)."""
    print(f"error: {err}", file=sys.stderr)
    return 2


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from ptdp.data.tokenizer import TokenizerError, train_tokenizer

    start = time.perf_counter()
    try:
        tok = train_tokenizer(args.input, args.model_prefix, args.vocab_size, args.type,
                              json_key=args.json_key, max_sentences=args.max_sentences,
                              verbose=args.verbose)
    except (TokenizerError, ValueError, OSError) as err:
        return _fail(err)
    print(f"wrote {tok.path} ({args.type}, vocab_size {tok.vocab_size}, special ids "
          f"{tok.special_ids()}) in {time.perf_counter() - start:.1f} s")
    return 0


# Megatron's --tokenizer-type names ptdp reads, and the file argument each one takes.
MEGATRON_TOKENIZERS = {
    "GPT2BPETokenizer": "vocab_file", "BertWordPieceLowerCase": "vocab_file",
    "BertWordPieceCase": "vocab_file", "SentencePieceTokenizer": "tokenizer_model",
    "GPTSentencePieceTokenizer": "tokenizer_model", "Llama2Tokenizer": "tokenizer_model",
    "HuggingFaceTokenizer": "tokenizer_model",
}


def tokenizer_arguments(args: argparse.Namespace) -> dict:
    """load_tokenizer's arguments from ptdp's --tokenizer or Megatron's spellings."""
    kind = args.tokenizer_type
    if kind is not None and kind not in MEGATRON_TOKENIZERS:
        raise ValueError(f"--tokenizer-type {kind}: ptdp reads {', '.join(MEGATRON_TOKENIZERS)} "
                         f"(tiktoken, null and multimodal tokenizers are not supported)")
    wanted = MEGATRON_TOKENIZERS.get(kind)
    path = args.tokenizer or getattr(args, wanted or "", None) or args.tokenizer_model \
        or args.vocab_file
    if not path:
        flag = f"--{wanted.replace('_', '-')}" if wanted else "--tokenizer"
        raise ValueError(f"no tokenizer: pass {flag}" + ("" if wanted else
                         " (or Megatron's --tokenizer-type with --vocab-file/--tokenizer-model)"))
    if kind is not None:
        _check_kind(kind, path)
    lowercase = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False}.get(kind)
    return {"tokenizer_path": path, "merge_file": args.merge_file, "lowercase": lowercase}


def _check_kind(kind: str, path: str) -> None:
    """The file must be what --tokenizer-type says (a GPT-2 type given a vocab.txt is a typo
    that would otherwise tokenise everything with the wrong model)."""
    from ptdp.data.tokenizer import is_hf_tokenizer
    from ptdp.data.vocab_tokenizers import GPT2, WORDPIECE, vocab_files

    if not Path(path).exists():
        raise ValueError(f"--tokenizer-type {kind}: {path} not found (a local file or directory "
                         f"is needed: Hugging Face hub names are not downloaded)")
    found = vocab_files(path)
    actual = found[0] if found else ("tokenizer.json" if is_hf_tokenizer(path) else "sentencepiece")
    expected = {"GPT2BPETokenizer": GPT2, "BertWordPieceLowerCase": WORDPIECE,
                "BertWordPieceCase": WORDPIECE, "HuggingFaceTokenizer": "tokenizer.json"}
    if actual != expected.get(kind, "sentencepiece"):
        raise ValueError(f"--tokenizer-type {kind} does not read {path} (a {actual} file)")


def cmd_preprocess(args: argparse.Namespace) -> int:
    from ptdp.data.indexed import IndexedDataError, IndexedDataset, sidecar_path
    from ptdp.data.preprocess import describe_dataset, preprocess

    try:
        tok_args = tokenizer_arguments(args)
        if args.describe:
            path = describe_dataset(args.output_prefix, sentences=args.split_sentences or None,
                                    **tok_args)
            print(f"wrote {path}")
            return 0
        if not args.input:
            raise ValueError("--input is required (except with --describe)")
        # Megatron's names (PREFIX_text_document) unless ptdp's own --json-key asks for PREFIX
        megatron_names = args.json_key is None
        summary = preprocess(args.input, output_prefix=args.output_prefix, workers=args.workers,
                             json_key=args.json_key or "text", json_keys=args.json_keys,
                             sentences=args.split_sentences, append_eod=args.append_eod,
                             megatron_names=megatron_names, progress=not args.quiet,
                             prepend_bos=args.tokenizer_type == "Llama2Tokenizer", **tok_args)
    except (ValueError, OSError, ImportError, IndexedDataError) as err:
        return _fail(err)
    for key, prefix in zip(summary["per_key"], summary["outputs"]):
        ds = IndexedDataset(prefix)
        print(f"wrote {ds.bin_path}, {ds.idx_path.name} and {sidecar_path(prefix).name}: "
              f"{ds.num_documents} documents, {len(ds)} sequences, {ds.num_tokens} tokens "
              f"({summary['per_key'][key]['skipped']} empty documents skipped)")
    print(f"in {summary['seconds']:.1f} s")
    return 0


def register(subparsers) -> None:
    tok = subparsers.add_parser("tokenizer", help="train a sentencepiece tokenizer")
    actions = tok.add_subparsers(dest="action", metavar="ACTION", required=True)
    train = actions.add_parser("train", help="train on JSONL (--json-key field) or plain text")
    train.add_argument("--input", required=True, help="corpus: .jsonl/.json or text, one doc per line")
    train.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    train.add_argument("--vocab-size", type=int, default=4096)
    train.add_argument("--type", choices=("bpe", "unigram"), default="bpe")
    train.add_argument("--json-key", default="text", help="JSONL field holding the text")
    train.add_argument("--max-sentences", type=int, default=2_000_000,
                       help="sample at most this many lines for training")
    train.add_argument("--verbose", action="store_true", help="show sentencepiece's log")
    train.set_defaults(func=cmd_tokenizer_train)

    pre = subparsers.add_parser(
        "preprocess", help="tokenise JSONL into Megatron-format .bin/.idx datasets",
        description="Tokenise JSONL (or text, one document per line) into Megatron-LM's indexed "
                    "format plus ptdp's PREFIX.ptdp.json sidecar. Megatron's "
                    "preprocess_data.py arguments work as they are, and outputs are named like "
                    "Megatron's: PREFIX_KEY_document (PREFIX_KEY_sentence with "
                    "--split-sentences), e.g. PREFIX_text_document; ptdp's --json-key KEY "
                    "writes PREFIX exactly.")
    pre.add_argument("--input", help="corpus: .jsonl/.json or text, one doc per line")
    pre.add_argument("--output-prefix", required=True,
                     help="writes PREFIX_text_document.{bin,idx,ptdp.json} (Megatron's "
                          "names, above); with --json-key, PREFIX.{bin,idx,ptdp.json}")
    pre.add_argument("--tokenizer", help="sentencepiece .model, Hugging Face tokenizer.json (or "
                     "its directory), GPT-2 vocab.json (merges.txt beside it) or WordPiece vocab.txt")
    pre.add_argument("--tokenizer-type", metavar="TYPE",
                     help=f"Megatron's tokenizer name: {', '.join(MEGATRON_TOKENIZERS)}")
    pre.add_argument("--vocab-file", help="GPT-2 vocab.json or WordPiece vocab.txt (Megatron's)")
    pre.add_argument("--merge-file", help="GPT-2 merges.txt (Megatron's)")
    pre.add_argument("--tokenizer-model",
                     help="sentencepiece .model or Hugging Face tokenizer (Megatron's)")
    pre.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8),
                     help="tokenising processes (default: CPU count, at most 8)")
    keys = pre.add_mutually_exclusive_group()
    keys.add_argument("--json-key", metavar="KEY",
                      help="ptdp's: the JSONL field holding the text, output named PREFIX "
                           "exactly (default: Megatron's names, field text)")
    keys.add_argument("--json-keys", nargs="+", metavar="KEY",
                      help="Megatron's: one dataset per field, named PREFIX_KEY_document")
    pre.add_argument("--split-sentences", action="store_true",
                     help="store sentence boundaries (needed for BERT)")
    pre.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                     help="end every document with the end-of-document token (Megatron's "
                          "default is off: there it needs --append-eod)")
    pre.add_argument("--describe", action="store_true",
                     help="write only the sidecar for an existing Megatron pair at "
                          "--output-prefix, from the tokenizer it was made with (no --input)")
    pre.add_argument("--quiet", action="store_true", help="no progress bars")
    pre.set_defaults(func=cmd_preprocess)
