"""The Megatron-LM arguments of a launch script, as `ptdp config from-megatron --script` reads
it: `\\` continuations joined, comments dropped, simple variables and arrays set in the script
(`NAME=value`, `NAME="..."`, `NAME=( ... )`, `NAME+=( ... )`, `export NAME=...`) expanded
wherever `$NAME`, `${NAME}`, `${NAME:-default}` or `${NAME[@]}` appear, and the words of the
line that runs `pretrain_*.py` (under torchrun, python or srun) returned.

This is not a shell: conditions and loops are not evaluated (every assignment counts, in
order), and what it cannot work out — positional parameters ($1), command substitutions,
arithmetic, variables the script does not set — is left as written and named in `unresolved`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

_ASSIGN = re.compile(r"^(?:export\s+|declare\s+(?:-\w+\s+)?|local\s+)?([A-Za-z_]\w*)(\+?)=(.*)$",
                     re.S)
_ARRAY_AT = re.compile(r'"?\$\{([A-Za-z_]\w*)\[[@*]\]\}"?')
_BRACED = re.compile(r"\$\{([A-Za-z_]\w*|\d+)(?::?-([^}]*))?\}")
_PLAIN = re.compile(r"\$([A-Za-z_]\w*|\d|@|\*)")
_UNEVALUATED = re.compile(r"\$\(\(?.*?\)\)?")
_OPENS_ARRAY = re.compile(r"^(?:export\s+)?[A-Za-z_]\w*\+?=\(")
_SCRIPT = re.compile(r"(^|/)pretrain_\w+\.py$")


class ScriptError(ValueError):
    """The file cannot be read, or no Megatron invocation is found in it."""


@dataclass
class Invocation:
    words: list[str]                      # the script and its arguments
    unresolved: list[str] = field(default_factory=list)   # "$1", "$((...))", "$UNSET", ...


def logical_lines(text: str) -> list[str]:
    """Lines with `\\` continuations joined and array assignments `NAME=( ... )` kept whole."""
    joined = re.sub(r"\\\r?\n", " ", text).splitlines()
    out, pending = [], None
    for line in joined:
        if pending is not None:
            pending += "\n" + line
            if _closes_array(line):
                out.append(pending)
                pending = None
            continue
        stripped = line.strip()
        if _OPENS_ARRAY.match(stripped) and not _closes_array(stripped):
            pending = stripped
        else:
            out.append(stripped)
    if pending is not None:
        out.append(pending)
    return out


def _closes_array(line: str) -> bool:
    code = line.split("#", 1)[0]
    return code.rstrip().endswith(")")


class _Expander:
    """Variables set so far (a string or a list of words) and what could not be expanded."""

    def __init__(self):
        self.vars: dict[str, str | list[str] | None] = {}
        self.unresolved: list[str] = []

    def _missing(self, text: str) -> str:
        if text not in self.unresolved:
            self.unresolved.append(text)
        return text

    def expand(self, text: str) -> str:
        def array(m):
            value = self.vars.get(m.group(1))
            if value is None:
                return self._missing(m.group(0).strip('"'))
            return " ".join(shlex.quote(w) for w in (value if isinstance(value, list) else [value]))

        def braced(m):
            value = self.vars.get(m.group(1))
            if value is None and m.group(2) is not None:
                return m.group(2).strip('"\'')
            return self._scalar(value, m.group(0))

        def plain(m):
            return self._scalar(self.vars.get(m.group(1)), m.group(0))

        for pattern in _UNEVALUATED.findall(text):
            self._missing(pattern)
        text = _ARRAY_AT.sub(array, text)
        return _PLAIN.sub(plain, _BRACED.sub(braced, text))

    def _scalar(self, value, written: str) -> str:
        if value is None:
            return self._missing(written)
        return " ".join(value) if isinstance(value, list) else value

    def assign(self, name: str, append: bool, rhs: str) -> None:
        rhs = rhs.strip()
        if _UNEVALUATED.search(rhs):
            self.vars[name] = None   # named when it is used
            return
        if rhs.startswith("("):
            words = _words(self.expand(rhs[1:rhs.rfind(")")]))
            old = self.vars.get(name) if append else []
            self.vars[name] = (old if isinstance(old, list) else []) + words
            return
        value = " ".join(_words(self.expand(rhs)))
        self.vars[name] = (self.vars.get(name) or "") + value if append else value


def _words(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:   # an unbalanced quote: split on blanks rather than give up
        return text.split()


def read_invocation(path: str | Path) -> Invocation:
    """The Megatron invocation of a launch script (the last line running pretrain_*.py)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ScriptError(f"{path}: cannot read the script: {err}") from None
    env, found = _Expander(), None
    for line in logical_lines(text):
        if not line or line.startswith("#"):
            continue
        match = _ASSIGN.match(line)
        if match and _is_assignment(match.group(3)):
            env.assign(match.group(1), bool(match.group(2)), match.group(3))
            continue
        before = list(env.unresolved)
        words = _command(_words(env.expand(line)))
        if words:
            found = words
        else:
            env.unresolved = before   # what an unrelated line could not expand does not matter
    if found is None:
        raise ScriptError(f"{path}: no line runs Megatron-LM's pretrain_*.py")
    return Invocation(found, _used_unresolved(found, env.unresolved))


_OPERATORS = {"|", "||", "&&", ";", "&", "|&"}
_REDIRECTION = re.compile(r"^(?:\d?>>?|&>|<|\d>&\d)")


def _command(words: list[str]) -> list[str] | None:
    """The simple command of a line that runs pretrain_*.py (`cd x && torchrun ... | tee log`
    -> the torchrun part), redirections dropped; None if the line runs no such script."""
    command: list[str] = []
    for word in words + [";"]:
        if word not in _OPERATORS:
            if not _REDIRECTION.match(word):
                command.append(word)
        elif any(_SCRIPT.search(w) for w in command):
            return command
        else:
            command = []
    return None


def _is_assignment(rhs: str) -> bool:
    """`NAME=value` alone, not `NAME=value command ...` (a variable set for one command)."""
    return rhs.lstrip().startswith("(") or len(_words(rhs)) <= 1

def _used_unresolved(words: list[str], unresolved: list[str]) -> list[str]:
    text = " ".join(words)
    return [u for u in unresolved if u in text]
