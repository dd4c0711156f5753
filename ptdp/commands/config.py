"""`ptdp config from-megatron`: a ptdp config from Megatron-LM's arguments or launch script."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ptdp.config.models import FAMILY_NAMES


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "config", help="write ptdp configs (from-megatron: translate Megatron-LM arguments)",
        description="Write ptdp configs. `ptdp config from-megatron` translates a Megatron-LM "
                    "command line or launch script.")
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
    sub = parser.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    from_megatron = sub.add_parser(
        "from-megatron", help="translate Megatron-LM arguments into a ptdp YAML config",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Translate Megatron-LM's arguments (pretrain_gpt.py, pretrain_bert.py)\n"
                    "into the equivalent ptdp YAML config. Where Megatron's default differs\n"
                    "from ptdp's (linear decay, Adam beta2 0.999, dropout 0.1, ...) and the\n"
                    "argument is absent, Megatron's default is written. Every argument not\n"
                    "mapped exactly gets one line:\n"
                    "  approximate: mapped, with the stated difference\n"
                    "  ignored:     irrelevant to ptdp (kernel and performance choices)\n"
                    "  refused:     ptdp has no counterpart; where the argument shapes the\n"
                    "               model, no config is written (exit 2) unless --allow-refused\n"
                    "  unknown:     not in ptdp's table of Megatron-LM arguments\n"
                    "  note:        what Megatron works out or changes at run time: applied\n"
                    "               as it does, or (model.vocab_size) for you to set\n"
                    "  unresolved:  a variable the script does not set\n"
                    "  conditional: an `if` of the script: which branch was applied, and why\n"
                    "The whole table: docs/migration.md, or --table.\n\n"
                    "  ptdp config from-megatron --out gpt.yaml -- --num-layers 24 ...\n"
                    "  ptdp config from-megatron --script train_gpt.sh --out gpt.yaml")
    from_megatron.add_argument("--script", metavar="FILE",
                               help="a launch script: the line running pretrain_*.py is read, with "
                                    "the variables and arrays the script sets expanded and the "
                                    "if-branches its own values select")
    from_megatron.add_argument("--out", metavar="FILE.yaml",
                               help="write the YAML here (default: stdout)")
    from_megatron.add_argument("--arch", choices=FAMILY_NAMES,
                               help="model.arch (default: bert for pretrain_bert.py, else gpt)")
    from_megatron.add_argument("--allow-refused", action="store_true",
                               help="write the config even when refused arguments shape the "
                                    "model (it then describes another model than Megatron's)")
    from_megatron.add_argument("--table", action="store_true",
                               help="print the whole argument table (Markdown) and exit")
    from_megatron.add_argument("megatron_args", nargs="*", metavar="-- ARGS",
                               help="Megatron-LM's arguments, after `--`")
    from_megatron.set_defaults(func=run_from_megatron)


def run_from_megatron(args) -> int:
    from ptdp.megatron.arguments import docs_table
    from ptdp.megatron.launch_script import ScriptError, read_invocation
    from ptdp.megatron.translate import Line, TranslationError, to_yaml, translate

    if args.table:
        print(docs_table(), end="")
        return 0
    if bool(args.script) == bool(args.megatron_args):
        print("ptdp config from-megatron: give either --script FILE or -- ARGS", file=sys.stderr)
        return 2
    try:
        if args.script:
            invocation = read_invocation(args.script)
            words, unresolved, source = invocation.words, invocation.unresolved, args.script
            branches = invocation.branches
        else:
            words, unresolved, source, branches = list(args.megatron_args), [], "", []
        result = translate(words, arch=args.arch)
    except (ScriptError, TranslationError) as err:
        print(f"ptdp config from-megatron: {err}", file=sys.stderr)
        return 2
    result.lines += [Line("unresolved", name, "not set in the script; written as it stands")
                     for name in unresolved]
    result.lines += [Line("conditional", head, why) for head, why in branches]
    if result.blocking and not args.allow_refused:
        for line in result.lines:
            print(f"  {line}", file=sys.stderr)
        flags = [line.argument.split()[0] for line in result.blocking]
        print(f"ptdp config from-megatron: refused {', '.join(flags)}: "
              f"{'it shapes' if len(flags) == 1 else 'they shape'} the model and ptdp has no "
              f"counterpart, so the config would be another model; none written "
              f"(--allow-refused writes it without {'it' if len(flags) == 1 else 'them'})",
              file=sys.stderr)
        return 2
    text = to_yaml(result, source)
    if args.out:
        try:
            Path(args.out).write_text(text)
        except OSError as err:
            print(f"ptdp config from-megatron: cannot write --out {args.out}: {err.strerror}",
                  file=sys.stderr)
            return 2
        print(f"ptdp config from-megatron: wrote {args.out} ({len(result.values)} keys)",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    for line in result.lines:
        print(f"  {line}", file=sys.stderr)
    return 0
