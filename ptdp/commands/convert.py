"""`ptdp convert`: checkpoints to and from Hugging Face `transformers` (ptdp/hf/convert.py)."""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert a checkpoint to or from Hugging Face transformers",
        description="ptdp convert CHECKPOINT --to hf OUT_DIR: a checkpoint of any layout to a "
                    "transformers model directory (GPT with GPT-2's block -> GPT2LMHeadModel, "
                    "with Llama's block -> LlamaForCausalLM, or Qwen2ForCausalLM with q/k/v-only "
                    "biases; BERT -> MegatronBertForPreTraining; model.safetensors, config.json, "
                    "tokenizer.json). ptdp convert HF_DIR --from hf --out CHECKPOINT "
                    "[parallel.tensor=T parallel.pipeline=P parallel.chunks=V ...]: a gpt2, "
                    "megatron-bert, llama, mistral or qwen2 model directory into a checkpoint of "
                    "that layout, tokenizer included, which `ptdp train ... "
                    "checkpoint.load=CHECKPOINT` continues from (fresh optimizer state). What a "
                    "model type cannot reproduce exactly (a sliding window, a rope scaling other "
                    "than llama3, ...) is refused in one line. Needs the hf extra: pip install "
                    "'ptdp[hf]'.")
    parser.add_argument("source", help="a ptdp checkpoint (dir or iter_N) or, with --from hf, "
                                       "a Hugging Face model directory")
    parser.add_argument("--to", nargs=2, metavar=("hf", "OUT_DIR"),
                        help="convert a ptdp checkpoint to a Hugging Face model directory")
    parser.add_argument("--from", dest="from_", choices=["hf"],
                        help="convert from this format into a ptdp checkpoint")
    parser.add_argument("--out", help="checkpoint directory to write (with --from hf)")
    parser.add_argument("--tokenizer", default=None,
                        help="sentencepiece .model or Hugging Face tokenizer.json (--to hf); "
                             "default: the checkpoint's copy, else its config's data.tokenizer")
    parser.add_argument("--iteration", type=int, default=0,
                        help="iteration the written checkpoint claims (--from hf): the LR "
                             "schedule and data position resume there")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="layout and other config overrides (--from hf)")
    parser.set_defaults(func=run)


def run(args) -> int:
    try:
        if args.to and args.to[0] != "hf":
            print(f"ptdp convert: --to {args.to[0]}: the only format is hf", file=sys.stderr)
            return 2
        if args.to and not args.from_:
            return _to_hf(args)
        if args.from_ == "hf" and not args.to:
            return _from_hf(args)
        print("ptdp convert: give either --to hf OUT_DIR or --from hf --out CHECKPOINT",
              file=sys.stderr)
        return 2
    except ImportError as err:
        print(f"ptdp convert: {err.name or err} is not installed: pip install 'ptdp[hf]'",
              file=sys.stderr)
        return 2


def _to_hf(args) -> int:
    from ptdp.checkpoint.layout import CheckpointError
    from ptdp.hf.convert import to_hf
    out_dir = args.to[1]
    if args.overrides:
        print(f"ptdp convert: --to hf takes no overrides (got {' '.join(args.overrides)})",
              file=sys.stderr)
        return 2
    try:
        info = to_hf(args.source, out_dir, args.tokenizer)
    except (CheckpointError, ValueError, FileNotFoundError, KeyError) as err:
        print(f"ptdp convert: {_message(err)}", file=sys.stderr)
        return 2
    tok = (f"tokenizer from {info['tokenizer']}" if info["tokenizer"]
           else "no tokenizer (the checkpoint names none; pass --tokenizer)")
    print(f"wrote {out_dir}: {info['class']}, {info['parameters']:,} parameters, from "
          f"{info['checkpoint']} (iteration {info['iteration']}); {tok}")
    return 0


def _from_hf(args) -> int:
    from ptdp.checkpoint.layout import CheckpointError
    from ptdp.config import ConfigError
    from ptdp.hf.convert import from_hf
    if not args.out:
        print("ptdp convert: --from hf needs --out CHECKPOINT", file=sys.stderr)
        return 2
    try:
        final, cfg = from_hf(args.source, args.out, list(args.overrides), args.iteration)
    except (CheckpointError, ConfigError, ValueError, FileNotFoundError, KeyError) as err:
        for line in getattr(err, "errors", None) or [_message(err)]:   # one line per problem
            print(f"ptdp convert: {line}", file=sys.stderr)
        return 2
    par = cfg.parallel
    print(f"wrote {final}: {cfg.model.arch}, layout (p, t, d, v) = ({par.pipeline}, "
          f"{par.tensor}, {par.data}, {par.chunks}); continue with `ptdp train CONFIG "
          f"checkpoint.load={args.out}`")
    return 0


def _message(err: Exception) -> str:
    """The error's text (a KeyError's str() would add quotes)."""
    return str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
