"""`ptdp` command line: one sub-command per module of ptdp/commands/.

Each command module exposes `register(subparsers)`, which adds its parser(s) and sets
`func=callable(args) -> int`. Modules import torch lazily so `ptdp --help` and `ptdp plan`
stay fast and torch-free. A command module that fails to import is an error, never a command
silently missing from `ptdp --help`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Modules that register sub-commands, in the order `ptdp --help` lists them.
COMMAND_MODULES = [
    "ptdp.commands.train",      # ptdp train
    "ptdp.commands.check",      # ptdp check
    "ptdp.commands.plan",       # ptdp plan
    "ptdp.commands.profile",    # ptdp profile
    "ptdp.commands.data",       # ptdp tokenizer, ptdp preprocess
    "ptdp.commands.timeline",   # ptdp timeline
    "ptdp.commands.convert",    # ptdp convert
    "ptdp.commands.generate",   # ptdp generate
    "ptdp.commands.plot",       # ptdp plot
    "ptdp.commands.config",     # ptdp config from-megatron
]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every --help shows each option's default (an option without one says nothing)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from ptdp import __version__
    parser = argparse.ArgumentParser(
        prog="ptdp", description="Train GPT and BERT models with pipeline, tensor and data "
                                 "parallelism (PTD-P), and plan their layout.")
    parser.add_argument("--version", action="version", version=f"ptdp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    _show_defaults(parser)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Give every (sub-)parser the defaults-showing formatter, keeping raw descriptions raw."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)
        elif action.help is None and action.default not in (None, False, argparse.SUPPRESS):
            action.help = "(default: %(default)s)"   # an option without help text
    if parser.formatter_class is argparse.RawDescriptionHelpFormatter:
        parser.formatter_class = type("RawHelpFormatter",
                                      (argparse.RawDescriptionHelpFormatter, HelpFormatter), {})
    elif parser.formatter_class in (argparse.HelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        parser.formatter_class = HelpFormatter


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "megatron_args", None) is not None:   # ptdp config from-megatron
        print("ptdp config from-megatron: put Megatron's arguments after `--`: "
              "ptdp config from-megatron [--out FILE] -- ARGS", file=sys.stderr)
        return 2
    hints = _megatron_spellings(argv, extra, getattr(args, "overrides", []))
    if hints:
        from ptdp.runtime.exit_status import CONFIG_ERROR, record_exit
        if os.environ.get("RANK", "0") == "0":   # under torchrun every rank found the same
            for hint in hints:
                print(f"ptdp {args.command}: {hint}", file=sys.stderr)
        record_exit(CONFIG_ERROR)   # the launch scripts' restart loop must not retry it
        return CONFIG_ERROR
    # argparse cannot take positionals after an option (`CONFIG --world-size 8 a.b=1`):
    # key=value words it left over are the command's overrides, in order.
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


def _megatron_spellings(argv: list[str], extra: list[str], overrides: list[str]) -> list[str]:
    """One line for each unrecognised word that is a Megatron-LM argument (`--flag value`, or a
    `flag_name=value` override that is not a ptdp key), saying what ptdp calls it."""
    suspects = [w for w in [*extra, *overrides] if w.startswith("--") or "=" in w]
    if not suspects:
        return []
    from ptdp.megatron.translate import command_line_hints
    return command_line_hints(argv, suspects)


if __name__ == "__main__":
    sys.exit(main())
