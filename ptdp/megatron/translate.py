"""Megatron-LM arguments -> a ptdp config: the table of ptdp/megatron/arguments.py applied to
one command line, Megatron's differing defaults written in, the YAML text, and the one-line
hints `ptdp train` gives when it meets a Megatron spelling.

`translate(words)` returns a `Translation`: the ptdp keys with their values and where each
came from, and one `Line` per argument it could not map exactly (approximate, ignored,
refused, unknown) or that needs the user (note). A refusal of an argument that shapes the model
`blocks`: `ptdp config from-megatron` then writes no config. Megatron's run-time adjustments
(ptdp/megatron/adjustments.py) follow the table. Torch-free.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import yaml

from ptdp.config.models import DEFAULT_FAMILY, MODEL_FAMILIES
from ptdp.config.schema import Config
from ptdp.megatron.adjustments import adjust
from ptdp.megatron.arguments import ARGS, Arg, lookup
from ptdp.megatron.converters import (APPROXIMATE, EXACT, IGNORED, REFUSED, Default, Differs,
                                      Unmapped)

UNKNOWN, NOTE = "unknown", "note"
FROM_MEGATRON = "ptdp config from-megatron -- ARGS"


class TranslationError(ValueError):
    """A command line Megatron itself would reject (a missing or malformed value)."""


@dataclass(frozen=True)
class Line:
    """One argument not mapped exactly: its kind, the argument as given, why. `blocks`: a
    refusal of something that shapes the model; the config would describe another model."""
    kind: str
    argument: str
    why: str
    blocks: bool = False

    def __str__(self) -> str:
        return f"{self.kind}: {self.argument}: {self.why}"


@dataclass
class Translation:
    values: dict[str, Any] = field(default_factory=dict)   # "section.key" -> value
    origin: dict[str, str] = field(default_factory=dict)   # "section.key" -> the argument
    lines: list[Line] = field(default_factory=list)

    def set(self, key: str, value: Any, origin: str) -> None:
        self.values[key] = value
        self.origin[key] = origin

    def drop(self, key: str) -> str:
        """Remove a key written earlier; returns the argument it came from."""
        del self.values[key]
        return self.origin.pop(key)

    def note(self, kind: str, argument: str, why: str, blocks: bool = False) -> None:
        self.lines.append(Line(kind, argument, why, blocks))

    @property
    def blocking(self) -> list[Line]:
        """The refusals that would make the config another model."""
        return [line for line in self.lines if line.blocks]

    def nested(self) -> dict:
        """{section: {key: value}} in the schema's order, as ptdp's loader reads it."""
        out: dict = {}
        for key in sorted(self.values, key=_schema_position):
            section, name = key.split(".", 1)
            out.setdefault(section, {})[name] = self.values[key]
        return out


# Reading a command line ----------------------------------------------------------------------

def split_invocation(words: list[str]) -> tuple[str | None, list[str]]:
    """(the Megatron script, its arguments): words after the last `*.py` (torchrun's options
    come before it); the whole list when there is no script."""
    scripts = [i for i, w in enumerate(words) if w.endswith(".py") and not w.startswith("-")]
    if not scripts:
        return None, list(words)
    return words[scripts[-1]], list(words[scripts[-1] + 1:])


def _split_words(words: list[str]) -> list[str]:
    """`--flag=value`, and "--flag value" quoted as one word (Megatron's example scripts do),
    -> two words."""
    out = []
    for word in words:
        if word.startswith("--") and "=" in word.split()[0]:
            flag, value = word.split("=", 1)
            out += [flag, value]
        elif word.startswith("--") and " " in word.strip():
            try:
                out += shlex.split(word)
            except ValueError:
                out += word.split()
        else:
            out.append(word)
    return out


def parse_arguments(words: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Megatron's flags -> their values (True for a switch, a list for a list argument; the last
    occurrence wins, as in argparse) and the positional words."""
    words, given, positional, i = _split_words(words), {}, [], 0
    while i < len(words):
        word = words[i]
        if not word.startswith("--"):
            positional.append(word)
            i += 1
            continue
        values = []
        i += 1
        while i < len(words) and not words[i].startswith("--"):
            values.append(words[i])
            i += 1
        given[word] = _values_for(word, lookup(word), values, positional)
    return given, positional


def _values_for(flag: str, arg: Arg | None, values: list[str], positional: list[str]) -> Any:
    if arg is None or arg.family:   # how many values it takes is unknown: all that follow
        return True if not values else values[0] if len(values) == 1 else values
    nargs = arg.nargs
    if nargs == 0:
        positional += values   # e.g. the script name after a switch
        return True
    if nargs in ("*", "+"):
        return values
    if len(values) < nargs:
        raise TranslationError(f"{flag} needs {nargs} value{'s' if nargs > 1 else ''}, "
                               f"got {len(values)}")
    positional += values[nargs:]
    return values[0] if nargs == 1 else values[:nargs]


# Applying the table --------------------------------------------------------------------------

def _script_family(script: str | None) -> str:
    """The model family a Megatron script's name names (pretrain_bert.py -> bert), else the
    default one (ptdp/config/models.py)."""
    name = script.rsplit("/", 1)[-1] if script else ""
    named = [f.name for f in MODEL_FAMILIES.values() if f is not DEFAULT_FAMILY and f.name in name]
    return named[0] if named else DEFAULT_FAMILY.name


def translate(words: list[str], arch: str | None = None, defaults: bool = True) -> Translation:
    """A ptdp config from Megatron-LM's arguments (`pretrain_gpt.py ARGS`, or ARGS alone).
    `arch` (gpt | bert) defaults to the script's name (pretrain_bert.py -> bert), else gpt;
    `defaults` writes Megatron's defaults where they differ from ptdp's."""
    script, argv = split_invocation(words)
    given, positional = parse_arguments(argv)
    for first, second in CONFLICTS:
        if first in given and second in given:
            raise TranslationError(f"{first} and {second} conflict: Megatron-LM refuses them "
                                   f"together; keep one")
    out = Translation()
    out.set("model.arch", arch or _script_family(script),
            "--arch" if arch else f"the script ({script})" if script else "ptdp's default")
    out.lines += [Line(UNKNOWN, w, "a word that is not an argument") for w in positional]
    for flag, value in given.items():
        _apply(lookup(flag), flag, value, given, out)
    if defaults:
        _megatron_defaults(given, out)
        out.lines += _required_but_absent(given)
        adjust(given, out)
    out.lines += _needs_the_user(out)
    return out


# Flags Megatron-LM's arguments.py refuses together (translated, the last would win silently).
CONFLICTS = (("--fp16", "--bf16"),)

# What pretrain_gpt.py / pretrain_bert.py insist on; absent, ptdp's tiny defaults would apply.
REQUIRED = (("--num-layers", "--encoder-num-layers"), ("--hidden-size",),
            ("--num-attention-heads",), ("--seq-length", "--encoder-seq-length"),
            ("--micro-batch-size", "--batch-size"), ("--lr",), ("--train-iters", "--train-samples"))


def _required_but_absent(given: dict) -> list[Line]:
    return [Line(NOTE, f"{' / '.join(flags)} absent",
                 "Megatron requires it; ptdp's default applies")
            for flags in REQUIRED if not any(f in given for f in flags)]


def _shown(flag: str, value: Any) -> str:
    if value is True:
        return flag
    return " ".join([flag, *value]) if isinstance(value, list) else f"{flag} {value}"


def _apply(arg: Arg | None, flag: str, value: Any, given: dict, out: Translation) -> None:
    shown = _shown(flag, value)
    if arg is None:
        out.lines.append(Line(UNKNOWN, shown,
                              "not in ptdp's table of Megatron-LM arguments: not translated"))
        return
    try:
        result = arg.convert(value, given) if arg.convert else value
    except Unmapped as err:
        out.lines.append(Line(err.kind, shown, err.why,
                              blocks=err.kind == REFUSED and arg.changes_model))
        return
    except (TypeError, ValueError):
        raise TranslationError(f"{shown}: not a valid value for {flag}") from None
    _write(arg, result, shown, out)


def _write(arg: Arg, result: Any, origin: str, out: Translation) -> None:
    if isinstance(result, Differs):
        out.lines.append(Line(APPROXIMATE, origin, result.why))
        result = result.value
    items = result.items() if isinstance(result, dict) else [(arg.key, result)]
    for key, value in items:
        out.set(key, value, origin)


def _megatron_defaults(given: dict, out: Translation) -> None:
    """Megatron's default of every absent argument whose ptdp default differs, written in."""
    for arg in ARGS:
        if arg.default is None or arg.flag in given or (arg.key and arg.key in out.values):
            continue
        origin = f"Megatron's default ({arg.flag} absent)"
        try:
            value = arg.default.value(given) if isinstance(arg.default, Default) else arg.default
        except Unmapped as err:
            out.lines.append(Line(err.kind, f"{arg.flag} absent", err.why))
            continue
        if value is None:
            continue
        result = arg.convert(value, given) if arg.convert else value
        if isinstance(result, Differs) or isinstance(result, dict):
            _write(arg, result, origin, out)
        elif _ptdp_default(arg.key) != result:
            out.set(arg.key, result, origin)


def _needs_the_user(out: Translation) -> list[Line]:
    """What Megatron works out at run time and a translation cannot."""
    lines = []
    if "data.tokenizer" in out.values and "model.vocab_size" not in out.values:
        lines.append(Line(NOTE, "model.vocab_size", "Megatron reads it from the tokenizer; set it "
                                                    "(ptdp check names the value)"))
    return lines


# ptdp's schema -------------------------------------------------------------------------------

_DEFAULTS = Config().to_dict()


def _schema_position(key: str) -> tuple[int, int]:
    """Where a key sits in ptdp's schema (sections, then fields in order); others last."""
    section, name = key.split(".", 1)
    sections = list(_DEFAULTS)
    if section not in _DEFAULTS:
        return len(sections), 0
    names = list(_DEFAULTS[section])
    return sections.index(section), names.index(name) if name in names else len(names)


def _ptdp_default(key: str) -> Any:
    section, name = key.split(".", 1)
    return _DEFAULTS.get(section, {}).get(name, dataclasses.MISSING)


def is_config_key(dotted: str) -> bool:
    section, _, name = dotted.partition(".")
    return name in _DEFAULTS.get(section, {})


# Writing the YAML ----------------------------------------------------------------------------

def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip()
    return text.removesuffix("...").strip()


def to_yaml(t: Translation, source: str = "") -> str:
    """The config as YAML, each key commented with the Megatron argument it came from."""
    head = ["# ptdp config written by `ptdp config from-megatron`"
            + (f" from {source}." if source else "."),
            "# Each key names the Megatron-LM argument it came from; \"Megatron's default\"",
            "# marks a default of Megatron's that differs from ptdp's, written so the run",
            "# behaves as it did.",
            "# Arguments not mapped exactly are listed below (and were printed).",
            ""]
    rows = []   # (text, origin) per line; sections have no origin
    for section, values in t.nested().items():
        rows.append((f"{section}:", None))
        rows += [(f"  {name}: {_scalar(value)}", t.origin[f"{section}.{name}"])
                 for name, value in values.items()]
    width = max((len(text) for text, origin in rows if origin), default=0) + 2
    body = [text if origin is None else f"{text:<{width}}# {origin}" for text, origin in rows]
    tail = ["", "# Not mapped exactly:"] + [f"#   {line}" for line in t.lines] if t.lines else []
    return "\n".join(head + body + tail) + "\n"


# Hints for Megatron spellings in ptdp's own command line -------------------------------------

def spelling_hint(flag: str, value: str | None = None, typed: str | None = None) -> str | None:
    """One line for a Megatron argument met where ptdp expects its own (None if it is not one):
    what ptdp calls it, or why ptdp has no counterpart. `typed`: the key the user wrote, when
    it is the very key the argument maps to (one this ptdp lacks): no hint then."""
    arg = lookup(flag)
    if arg is None or (typed is not None and typed == arg.key):
        return None
    words = [flag] + ([value] if value is not None and arg.nargs != 0 else [])
    try:
        t = translate(words, defaults=False)
    except TranslationError:
        t = None
    pairs = [f"{k}={_scalar(v)}" for k, v in (t.values.items() if t else []) if k != "model.arch"]
    if pairs:
        return (f"{' '.join(words)} is Megatron-LM's spelling of {' '.join(pairs)}; "
                f"`{FROM_MEGATRON}` translates a whole Megatron command line")
    if arg.key and arg.kind == EXACT:
        return (f"{flag} is Megatron-LM's spelling of {arg.key}; write {arg.key}=VALUE "
                f"(`{FROM_MEGATRON}` translates a whole Megatron command line)")
    why = t.lines[0].why if t and t.lines else arg.note
    verb = {REFUSED: "has no counterpart for", IGNORED: "ignores"}.get(
        arg.kind, "maps only approximately")
    return f"{flag} is a Megatron-LM argument that ptdp {verb}: {why}"


def command_line_hints(argv: list[str], suspects: list[str]) -> list[str]:
    """Hints for the words of `argv` that ptdp did not recognise (`suspects`) and that are
    Megatron spellings: `--flag [value]`, `--flag=value`, or a `flag_name=value` override."""
    hints = []
    for i, word in enumerate(argv):
        if word not in suspects:
            continue
        flag, value = _as_flag(word)
        if flag is None:
            continue
        if value is None and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            value = argv[i + 1]
        hint = spelling_hint(flag, value, None if word.startswith("--") else word.split("=")[0])
        if hint:
            hints.append(hint if word.startswith("--") else f"{word}: {hint}")
    return hints


def _as_flag(word: str) -> tuple[str | None, str | None]:
    """`--flag`, `--flag=value`, `flag_name=value` or `section.flag_name=value` -> (--flag, value)
    when it is not one of ptdp's own keys."""
    if word.startswith("--"):
        flag, _, value = word.partition("=")
        return flag, value or None
    dotted, eq, value = word.partition("=")
    if not eq or is_config_key(dotted):
        return None, None
    return "--" + dotted.rpartition(".")[2].replace("_", "-"), value


_UNKNOWN_KEY = re.compile(r"^unknown key '(\w+)\.(\w+)'")


def explain_config_errors(lines: list[str]) -> list[str]:
    """Config errors with the Megatron hint added to an unknown key spelled like Megatron's."""
    out = []
    for line in lines:
        match = _UNKNOWN_KEY.match(line)
        hint = spelling_hint("--" + match.group(2).replace("_", "-"),
                             typed=f"{match.group(1)}.{match.group(2)}") if match else None
        out.append(f"{line}; {hint}" if hint else line)
    return out
