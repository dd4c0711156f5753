"""`ptdp tokenizer train` and `ptdp preprocess`: thin argparse wrappers.

sentencepiece, datasets and tqdm are imported inside the commands, so registering these
parsers costs nothing for `ptdp --help` or `ptdp train`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _fail(err: Exception) -> int:
    print(f"error: {err}", file=sys.stderr)
    return 1


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


def cmd_preprocess(args: argparse.Namespace) -> int:
    from ptdp.data.indexed import IndexedDataset
    from ptdp.data.preprocess import preprocess

    try:
        summary = preprocess(args.input, args.tokenizer, args.output_prefix,
                             workers=args.workers, json_key=args.json_key,
                             sentences=args.split_sentences, progress=not args.quiet)
    except (ValueError, OSError, ImportError) as err:
        return _fail(err)
    ds = IndexedDataset(args.output_prefix)
    print(f"wrote {ds.bin_path} and {ds.idx_path}: {ds.num_documents} documents, {len(ds)} "
          f"sequences, {ds.num_tokens} tokens ({summary['skipped']} empty documents skipped) "
          f"in {summary['seconds']:.1f} s")
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

    pre = subparsers.add_parser("preprocess", help="tokenise JSONL into a .bin/.idx dataset")
    pre.add_argument("--input", required=True, help="corpus: .jsonl/.json or text, one doc per line")
    pre.add_argument("--tokenizer", required=True,
                     help="sentencepiece .model file or Hugging Face tokenizer.json")
    pre.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    pre.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8),
                     help="tokenising processes (default: CPU count, at most 8)")
    pre.add_argument("--json-key", default="text", help="JSONL field holding the text")
    pre.add_argument("--split-sentences", action="store_true",
                     help="store sentence boundaries (needed for BERT)")
    pre.add_argument("--quiet", action="store_true", help="no progress bars")
    pre.set_defaults(func=cmd_preprocess)
