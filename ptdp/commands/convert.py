"""`ptdp convert`: checkpoints to and from Hugging Face `transformers` (ptdp/hf/convert.py) and
Megatron-LM (ptdp/megatron/checkpoint.py)."""

from __future__ import annotations

import os
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert a checkpoint to or from Hugging Face transformers or Megatron-LM",
        description="ptdp convert CHECKPOINT --to hf OUT_DIR: a checkpoint of any layout to a "
                    "transformers model directory (the first class that computes the model: "
                    "GPT with GPT-2's block -> GPT2LMHeadModel; Llama's block -> LlamaForCausalLM, "
                    "Mistral's with a window, Qwen2's with q/k/v-only biases, Qwen3's with "
                    "QK-norm, Gemma's with its options; with experts Mixtral, Qwen2-MoE, "
                    "Qwen3-MoE; with latent attention DeepseekV3ForCausalLM; BERT -> MegatronBertForPreTraining; model.safetensors, config.json, "
                    "tokenizer.json, generation_config.json with every end id; --model-type "
                    "picks another class, e.g. phi3). ptdp convert HF_DIR --from hf --out "
                    "CHECKPOINT [parallel.tensor=T parallel.pipeline=P parallel.chunks=V "
                    "model.seq_length=S ...]: a model directory of a family docs/models.md "
                    "lists into a checkpoint of that layout, tokenizer included, which `ptdp "
                    "train ... checkpoint.load=CHECKPOINT` continues from (fresh optimizer "
                    "state); a rotary model trains at model.seq_length=4096 unless told (up to "
                    "its max_position_embeddings), a learned position table is cut to a shorter "
                    "model.seq_length. What a "
                    "model type cannot reproduce exactly (logit soft-capping, a rope scaling "
                    "other than llama3, ...) is refused in one line. Needs the hf extra: pip install "
                    "'ptdp[hf]'. ptdp convert MEGATRON_DIR --from megatron --out CHECKPOINT "
                    "[overrides]: a Megatron-LM checkpoint of a megatron-core GPT (dense or MoE) "
                    "or BERT (legacy mp_rank_* files of any tensor/pipeline/virtual/expert "
                    "split, or torch_dist; without Megatron-LM's args, model.* overrides or a "
                    "run_config.yaml beside it give the shape), resuming at its iteration. "
                    "ptdp convert CHECKPOINT --to megatron OUT_DIR [parallel.tensor=T "
                    "parallel.pipeline=P parallel.expert=E] [--ckpt-format torch] "
                    "[--transformer-impl local]: a Megatron-LM checkpoint, torch_dist by "
                    "default or legacy files of that split; it prints the Megatron-LM "
                    "arguments that load it. See docs/migration.md.")
    parser.add_argument("source", help="a ptdp checkpoint (dir or iter_N) or, with --from, a "
                                       "Hugging Face model directory or a Megatron-LM checkpoint "
                                       "(its dir, iter_NNNNNNN or release)")
    parser.add_argument("--to", nargs=2, metavar=("FORMAT", "OUT_DIR"),
                        help="convert a ptdp checkpoint to FORMAT hf (a Hugging Face model "
                             "directory) or megatron (a Megatron-LM checkpoint)")
    parser.add_argument("--from", dest="from_", choices=FORMATS,
                        help="convert from this format into a ptdp checkpoint")
    parser.add_argument("--out", help="checkpoint directory to write (with --from)")
    parser.add_argument("--tokenizer", default=None,
                        help="sentencepiece .model or Hugging Face tokenizer.json (--to hf: "
                             "default the checkpoint's copy, else its config's data.tokenizer; "
                             "--from megatron: copied into the checkpoint, its data.tokenizer)")
    parser.add_argument("--iteration", type=int, default=None,
                        help="iteration the written checkpoint claims (--from): the LR schedule "
                             "and data position resume there; default 0 (hf) or the Megatron "
                             "checkpoint's own")
    parser.add_argument("--model-type", metavar="TYPE",
                        help="--to hf: the transformers model_type to write (e.g. phi3); "
                             "default the first whose block is the model's (gpt2, llama, "
                             "mistral, qwen2, ...)")
    parser.add_argument("--transformer-impl", choices=["transformer_engine", "local"],
                        help="--to megatron: name the norms as Megatron-LM's "
                             "--transformer-impl does (its default is transformer_engine)")
    parser.add_argument("--ckpt-format", choices=["torch_dist", "torch"],
                        help="--to megatron: Megatron-LM's --ckpt-format to write: torch_dist "
                             "(the default, as Megatron-LM's; any split loads it) or torch (legacy mp_rank_* "
                             "files of the parallel.tensor x parallel.pipeline split)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="layout and other config overrides (--from); with --to megatron "
                             "only parallel.tensor and parallel.pipeline, the split to write")
    parser.set_defaults(func=run)


FORMATS = ["hf", "megatron"]
SOURCES = {"ptdp": "a ptdp checkpoint (its directory or an iter_N in it)",
           "hf": "a Hugging Face model directory",
           "megatron": "a Megatron-LM checkpoint (its directory, an iter_NNNNNNN or release)"}


def _misplaced(args) -> str | None:
    """The first option given where it does nothing, as `--flag applies only to ...`."""
    to = args.to[0] if args.to else None
    where = {"--out": (args.out, args.from_, "--from"),
             "--iteration": (args.iteration, args.from_, "--from"),
             "--tokenizer": (args.tokenizer, to == "hf" or args.from_ == "megatron",
                             "--to hf and --from megatron"),
             "--model-type": (args.model_type, to == "hf", "--to hf"),
             "--transformer-impl": (args.transformer_impl, to == "megatron", "--to megatron"),
             "--ckpt-format": (args.ckpt_format, to == "megatron", "--to megatron")}
    for flag, (value, applies, modes) in where.items():
        if value is not None and not applies:
            return f"{flag} applies only to {modes}"
    return None


def run(args) -> int:
    try:
        if args.to and args.to[0] not in FORMATS:
            print(f"ptdp convert: --to {args.to[0]}: the formats are hf and megatron",
                  file=sys.stderr)
            return 2
        if (args.to or args.from_) and _misplaced(args):
            print(f"ptdp convert: {_misplaced(args)}", file=sys.stderr)
            return 2
        if (args.to or args.from_) and not os.path.exists(args.source):
            # before the converters import torch and transformers (seconds)
            what = SOURCES[args.from_ or "ptdp"]
            print(f"ptdp convert: {args.source} does not exist: give {what}", file=sys.stderr)
            return 2
        if args.to and not args.from_:
            return _to_hf(args) if args.to[0] == "hf" else _to_megatron(args)
        if args.from_ and not args.to:
            return _from_hf(args) if args.from_ == "hf" else _from_megatron(args)
        print("ptdp convert: give either --to hf|megatron OUT_DIR or --from hf|megatron --out "
              "CHECKPOINT", file=sys.stderr)
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
        info = to_hf(args.source, out_dir, args.tokenizer, args.model_type)
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
        final, cfg = from_hf(args.source, args.out, list(args.overrides), args.iteration or 0)
    except (CheckpointError, ConfigError, ValueError, FileNotFoundError, KeyError) as err:
        for line in getattr(err, "errors", None) or [_message(err)]:   # one line per problem
            print(f"ptdp convert: {line}", file=sys.stderr)
        return 2
    from ptdp.config.windows import window_notes
    model = cfg.model
    for note in window_notes(model):
        print(f"ptdp convert: note: {note}", file=sys.stderr)
    if model.max_positions > model.seq_length and not any(
            o.startswith("model.seq_length=") for o in args.overrides):
        print(f"ptdp convert: note: model.seq_length={model.seq_length} (the model supports "
              f"{model.max_positions} positions; give model.seq_length=N up to that to train "
              f"longer sequences)", file=sys.stderr)
    if not cfg.data.tokenizer:
        print(f"ptdp convert: note: {args.source} has no tokenizer files (tokenizer.json or "
              f"tokenizer.model): the checkpoint names none; set data.tokenizer to train on "
              f"text and pass --tokenizer to ptdp generate", file=sys.stderr)
    par = cfg.parallel
    print(f"wrote {final}: {cfg.model.arch}, layout (p, t, d, v) = ({par.pipeline}, "
          f"{par.tensor}, {par.data}, {par.chunks}); continue with `ptdp train CONFIG "
          f"checkpoint.load={args.out}`")
    return 0


def _from_megatron(args) -> int:
    from ptdp.checkpoint.layout import CheckpointError
    from ptdp.config import ConfigError
    from ptdp.megatron.checkpoint import from_megatron
    if not args.out:
        print("ptdp convert: --from megatron needs --out CHECKPOINT", file=sys.stderr)
        return 2
    try:
        final, cfg, found = from_megatron(args.source, args.out, list(args.overrides),
                                          args.iteration, args.tokenizer)
    except (CheckpointError, ConfigError, ValueError, FileNotFoundError, KeyError) as err:
        for line in getattr(err, "errors", None) or [_message(err)]:
            print(f"ptdp convert: {line}", file=sys.stderr)
        return 2
    for note in found["notes"]:
        print(f"ptdp convert: note: {note}", file=sys.stderr)
    par = cfg.parallel
    print(f"wrote {final}: {cfg.model.arch} from Megatron's {found['format']} checkpoint "
          f"{found['directory']} (iteration {found['iteration']}), layout (p, t, d, v) = "
          f"({par.pipeline}, {par.tensor}, {par.data}, {par.chunks}); continue with "
          f"`ptdp train CONFIG checkpoint.load={args.out}`")
    return 0


def _to_megatron(args) -> int:
    from ptdp.checkpoint.layout import CheckpointError
    from ptdp.megatron.checkpoint import to_megatron_checkpoint
    split = {"parallel.tensor": 1, "parallel.pipeline": 1, "parallel.expert": 1}
    for item in args.overrides:
        key, _, value = item.partition("=")
        if key not in split or not value.isdigit():
            print(f"ptdp convert: --to megatron takes only parallel.tensor=T, "
                  f"parallel.pipeline=P and parallel.expert=E (got {item})", file=sys.stderr)
            return 2
        split[key] = int(value)
    try:
        ckpt_format = args.ckpt_format or "torch_dist"
        info = to_megatron_checkpoint(args.source, args.to[1], split["parallel.tensor"],
                                      split["parallel.pipeline"],
                                      args.transformer_impl or "transformer_engine", ckpt_format,
                                      expert=split["parallel.expert"])
    except (CheckpointError, ValueError, FileNotFoundError, KeyError) as err:
        print(f"ptdp convert: {_message(err)}", file=sys.stderr)
        return 2
    meg = info["args"]
    if info["padded_rows"]:
        print(f"ptdp convert: note: the vocabulary ({meg.padded_vocab_size - info['padded_rows']}"
              f") is not a multiple of the tensor size; Megatron's {info['padded_rows']} padding "
              f"rows are zeros, whose logits (0) enter its softmax", file=sys.stderr)
    split_text = ("" if ckpt_format == "torch_dist" else
                  f", tensor {split['parallel.tensor']} x pipeline {split['parallel.pipeline']}"
                  f" x expert {split['parallel.expert']}")
    print(f"wrote {info['directory']}: {info['arch']}, {info['parameters']:,} parameters, from "
          f"{info['checkpoint']} (iteration {info['iteration']}){split_text}; load it in "
          f"Megatron-LM with --load {args.to[1]} {' '.join(info['load_flags'])}")
    return 0


def _message(err: Exception) -> str:
    """The error's text (a KeyError's str() would add quotes)."""
    return str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
