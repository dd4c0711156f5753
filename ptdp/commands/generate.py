"""`ptdp generate CHECKPOINT --prompt TEXT`: sample text from a GPT checkpoint (ptdp/inference/generate.py).

Prompts get the tokenizer's own special tokens, or its chat template with --chat, and a
generation ends at any end id (ptdp/inference/prompts.py), as transformers' generate does.

Out-of-range arguments (--max-new-tokens < 1, --temperature < 0, --top-p outside (0, 1],
--top-k < 0) are refused by the parser: one line, exit code 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _bounded(kind, low=None, high=None, low_open=False, what: str = ""):
    """An argparse type: `kind` within [low, high] (low excluded when low_open), else the
    error argparse reports (as 'argument --NAME: must be WHAT, got TEXT')."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            number = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {number}, got {text!r}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high) or value != value:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    return parse


def _one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Argument errors as one line (no usage block) and exit code 2."""
    def error(message: str):
        parser.exit(2, f"ptdp generate: {message} (see ptdp generate --help)\n")
    parser.error = error


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text from a GPT or Llama-style checkpoint of any layout",
        description="Loads a GPT or Llama-style checkpoint of any (p, t, c, d, v) into one "
                    "process and continues "
                    "each prompt. Temperature 0 is greedy decoding; otherwise top-k and top-p "
                    "cut the distribution before a seeded draw. Uses a key/value cache. "
                    "The prompt is tokenised as transformers' tokenizer(prompt) does (BOS "
                    "where the tokenizer adds one); generation stops at any end id (the "
                    "tokenizer's, generation_config.json's, --stop).")
    parser.add_argument("checkpoint", help="checkpoint directory (follows `latest`) or an iter_N")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="the text to continue")
    what.add_argument("--prompt-file", help="a file with one prompt per line")
    parser.add_argument("--max-new-tokens", default=32, help="tokens to add per prompt",
                        type=_bounded(int, low=1, what="at least 1"))
    parser.add_argument("--temperature", default=0.0, help="0 = greedy",
                        type=_bounded(float, low=0.0, what=">= 0 (0 = greedy)"))
    parser.add_argument("--top-k", default=0, help="keep the k likeliest tokens (0 = all)",
                        type=_bounded(int, low=0, what=">= 0 (0 = all)"))
    parser.add_argument("--top-p", default=1.0,
                        help="keep the likeliest tokens up to this total probability (1 = all)",
                        type=_bounded(float, low=0.0, high=1.0, low_open=True,
                                      what="in (0, 1] (1 = all)"))
    parser.add_argument("--seed", type=int, default=1234, help="seed of the sampling draws")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto = cuda if available")
    parser.add_argument("--tokenizer", default=None,
                        help="sentencepiece .model or Hugging Face tokenizer.json; default: "
                             "the checkpoint's copy, else its config's data.tokenizer")
    parser.add_argument("--chat", action="store_true",
                        help="apply the tokenizer's chat template to each prompt (one user "
                             "message, then the assistant's turn) and print the reply")
    parser.add_argument("--stop", type=int, nargs="+", default=[], metavar="ID",
                        help="token ids that also end a generation (besides the tokenizer's "
                             "end of text and generation_config.json's eos_token_id)")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute every position at each step (slow; for checking)")
    parser.add_argument("--speculative", action="store_true",
                        help="draft each next token with the checkpoint's multi-token-"
                             "prediction depth (model.mtp_layers) and check it in the "
                             "decoder's next forward: greedy gives the same tokens, sampling "
                             "the same distribution, in fewer forwards; prints how many "
                             "drafts were kept")
    parser.set_defaults(func=run)
    _one_line_errors(parser)


def _prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.prompt_file)
    if not path.is_file():
        raise FileNotFoundError(f"--prompt-file {path}: no such file")
    prompts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompt-file {path} has no non-empty line")
    return prompts


def run(args) -> int:
    from ptdp.checkpoint.layout import CheckpointError, find_checkpoint, read_metadata
    from ptdp.data.tokenizer import TokenizerError, checked_tokenizer
    from ptdp.inference.generate import Sampling, generate
    from ptdp.inference.local_model import LocalModel, checkpoint_tokenizer
    from ptdp.inference.prompts import Prompts
    from ptdp.runtime.startup import NoDevice, pick_device

    from ptdp.inference.speculative import generate_speculative
    if args.speculative and args.no_cache:
        print("ptdp generate: --speculative decodes with the cache: drop --no-cache",
              file=sys.stderr)
        return 2
    try:
        prompts = _prompts(args)
        directory, _ = find_checkpoint(args.checkpoint)
        path = checkpoint_tokenizer(directory, read_metadata(directory), args.tokenizer)
        if path is None:
            raise FileNotFoundError(f"{directory} names no tokenizer; pass --tokenizer FILE.model "
                                    f"or tokenizer.json")
        model = LocalModel.from_checkpoint(directory).to(
            pick_device(args.device, "ptdp generate --device"))
        tok = checked_tokenizer(path, model.cfg.vocab_size)
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        drafts = _drafts(model) if args.speculative else None
        made = Prompts(path, tok)
        stop = made.end_ids(args.stop)
        for i, text in enumerate(prompts):
            ids = made.encode(text, chat=args.chat)
            new = (generate_speculative(model, ids, args.max_new_tokens, sampling, stop, drafts)
                   if drafts is not None else
                   generate(model, ids, args.max_new_tokens, sampling, stop,
                            use_cache=not args.no_cache))
            if len(prompts) > 1:
                print(f"--- prompt {i + 1}")
            reply = _completion(tok, ids, new)
            print(reply.lstrip() if args.chat else text + reply, flush=True)
        if drafts is not None:
            print(f"ptdp generate: {drafts.accepted} of {drafts.proposed} drafts kept",
                  file=sys.stderr)
    except (CheckpointError, TokenizerError, ValueError, FileNotFoundError, NoDevice) as err:
        print(f"ptdp generate: {err}", file=sys.stderr)
        return 2
    return 0


def _drafts(model):
    """The count of --speculative's drafts across the prompts, once the checkpoint is known to
    have a depth to draft with (refused before any prompt runs)."""
    from ptdp.inference.speculative import Drafts, MtpDrafter
    MtpDrafter(model)
    return Drafts()


def _completion(tok, prompt_ids: list[int], new: list[int]) -> str:
    """The new tokens as text, with the space sentencepiece drops when they decode alone."""
    return tok.decode(prompt_ids + new)[len(tok.decode(prompt_ids)):]
