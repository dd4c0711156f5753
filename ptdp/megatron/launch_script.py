"""The Megatron-LM arguments of a launch script, as `ptdp config from-megatron --script` reads
it: `\\` continuations joined, comments dropped, simple variables and arrays set in the script
(`NAME=value`, `NAME="..."`, `NAME=( ... )`, `NAME+=( ... )`, `export NAME=...`) expanded
wherever `$NAME`, `${NAME}`, `${NAME:-default}` or `${NAME[@]}` appear, and the words of the
line that runs `pretrain_*.py` (under torchrun, python or srun) returned.

This is not a shell. Loops are not run. An `if`/`elif`/`else` is followed where its tests
(`[[ "$X" == "v" ]]`, `!=`, `-z`, `-n`, joined by `||` and `&&`) read only variables the
script sets, or defaults such as `${3:-"MOCK"}`: only the branch they select counts. Where a
test reads anything else (the environment, a file), no branch counts. Either way, an `if`
whose branches set variables or run Megatron is named in `branches`, with the variables it
tests, so a translation never silently merges or drops a script's alternatives. What cannot be
worked out — positional parameters ($1), command substitutions, arithmetic, variables the
script does not set — is left as written and named in `unresolved`.
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
    branches: list[tuple[str, str]] = field(default_factory=list)   # (the if, what was applied)


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
            out += _one_line_if(stripped)
    if pending is not None:
        out.append(pending)
    return out


def _one_line_if(line: str) -> list[str]:
    """`if C; then A; else B; fi` on one line -> its parts, one per line, as if written out."""
    if not (line.startswith("if ") and re.search(r";\s*fi$", line)):
        return [line]
    parts, word, quote = [], "", None
    for char in line:
        if char in "\"'" and quote in (None, char):
            quote = None if quote else char
        if char == ";" and quote is None:
            parts.append(word.strip())
            word = ""
        else:
            word += char
    parts.append(word.strip())
    out = []
    for part in filter(None, parts):   # "then A" and "else B" start their branch's first line
        keyword, _, rest = part.partition(" ")
        if keyword in ("then", "else") and rest:
            out += [keyword, rest.strip()]
        else:
            out.append(part)
    return out


def _closes_array(line: str) -> bool:
    code = line.split("#", 1)[0]
    return code.rstrip().endswith(")")


class _Expander:
    """Variables set so far (a string or a list of words) and what could not be expanded."""

    def __init__(self):
        self.vars: dict[str, str | list[str] | None] = {}
        self.unresolved: list[str] = []
        self.defaulted: dict[str, str] = {}   # NAME -> "$3": NAME took the default of $3
        self._defaults_used: list[str] = []

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
                self._defaults_used.append(f"${m.group(1)}")
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
        self._defaults_used = []
        self._assign(name, append, rhs)
        if self._defaults_used:
            self.defaulted[name] = ", ".join(self._defaults_used)
        else:
            self.defaulted.pop(name, None)

    def _assign(self, name: str, append: bool, rhs: str) -> None:
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
    env, found, branches = _Expander(), None, _Branches()
    for line in logical_lines(text):
        if not line or line.startswith("#") or branches.follow(line, env):
            continue
        match = _ASSIGN.match(line)
        if match and _is_assignment(match.group(3)):
            if branches.counts():
                env.assign(match.group(1), bool(match.group(2)), match.group(3))
            continue
        before = list(env.unresolved)
        words = _command(_words(env.expand(line)))
        if words and branches.counts():
            found = words
        else:
            env.unresolved = before   # what an unrelated line could not expand does not matter
    if found is None:
        raise ScriptError(f"{path}: no line runs Megatron-LM's pretrain_*.py")
    return Invocation(found, _used_unresolved(found, env.unresolved), branches.reports)


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


# Conditionals ---------------------------------------------------------------------------------

_IF = re.compile(r"^(if|elif)\s+(.*?)(?:;\s*then)?\s*$", re.S)
_TESTED = re.compile(r"\$\{?([A-Za-z_]\w*|\d+)")
_GLOB = re.compile(r"[*?\[]")


@dataclass
class _If:
    """One `if` being read: its tests, whether the branch being read counts, and whether an
    earlier branch was taken (`taken`) or could not be decided (`unknown`)."""
    head: str
    active: bool
    taken: str | None = None        # the branch that counts: "then", "elif ...", "else"
    unknown: bool = False
    tested: dict[str, str] = field(default_factory=dict)   # NAME -> what the script set
    work: bool = False              # a branch sets variables or runs Megatron


class _Branches:
    """The `if`s around the line being read (see the module docstring)."""

    def __init__(self):
        self.open: list[_If] = []
        self.reports: list[tuple[str, str]] = []

    def counts(self) -> bool:
        """Whether a line that sets a variable or runs Megatron counts here (and note it)."""
        for frame in self.open:
            frame.work = True
        return all(frame.active for frame in self.open)

    def follow(self, line: str, env: _Expander) -> bool:
        """Read an if/elif/else/then/fi line; False for any other line."""
        word = line.split(None, 1)[0].rstrip(";")
        if word == "then":
            return True
        if word == "if":
            frame = _If(line, active=False)
            self.open.append(frame)
            self._branch(frame, "then", _IF.match(line).group(2), env)
            return True
        if word == "elif" and self.open:
            self._branch(self.open[-1], line, _IF.match(line).group(2), env)
            return True
        if word == "else" and self.open:
            frame = self.open[-1]
            frame.active = frame.taken is None and not frame.unknown
            frame.taken = frame.taken or ("else" if frame.active else None)
            return True
        if word == "fi" and self.open:
            frame = self.open.pop()
            if frame.work:
                self.reports.append((frame.head.removesuffix("; then"), _report(frame)))
            return True
        return False

    @staticmethod
    def _branch(frame: _If, label: str, condition: str, env: _Expander) -> None:
        for name in _TESTED.findall(condition):
            frame.tested[name] = _shown_value(name, env)
        value = None if frame.taken or frame.unknown else _evaluate(condition, env)
        frame.active = value is True
        frame.unknown = frame.unknown or (value is None and frame.taken is None)
        if frame.active:
            frame.taken = label


def _shown_value(name: str, env: _Expander) -> str:
    value = env.vars.get(name)
    if value is None:
        return "not set in the script"
    shown = shlex.quote(" ".join(value) if isinstance(value, list) else value)
    return f"{shown} (the default of {env.defaulted[name]})" if name in env.defaulted else shown


def _report(frame: _If) -> str:
    tested = ", ".join(f"{name}={value}" if not value.startswith("not set") else
                       f"{name} ({value})" for name, value in frame.tested.items()) \
        or "no variable (a file or a command)"
    if frame.unknown:
        return (f"no branch applied: it tests {tested}; add the arguments of the branch that "
                f"applies by hand")
    if frame.taken is None:
        return f"no branch applied: it tests {tested}"
    return (f"only the '{frame.taken.removesuffix('; then')}' branch applied: it tests {tested}; "
            f"change these and translate again for another branch")


def _evaluate(condition: str, env: _Expander) -> bool | None:
    """`[[ A == B ]] || [ -z A ] && ...` with what the script set; None where it tests
    something else (a variable the script does not set, a file, a pattern)."""
    if any(env.vars.get(name) is None and not _has_default(name, condition)
           for name in _TESTED.findall(condition)):
        return None
    saved = list(env.unresolved)
    try:
        words = shlex.split(env.expand(condition))
    except ValueError:
        return None
    finally:
        env.unresolved = saved
    result, joiner, test = None, None, []
    for word in words + ["&&"]:
        if word not in ("&&", "||"):
            test.append(word)
            continue
        value = _test([w for w in test if w not in ("[", "]", "[[", "]]")])
        if value is None:
            return None
        result = value if joiner is None else (result and value if joiner == "&&"
                                               else result or value)
        joiner, test = word, []
    return result


def _has_default(name: str, condition: str) -> bool:
    return re.search(r"\$\{" + re.escape(name) + r":?-", condition) is not None


def _test(words: list[str]) -> bool | None:
    if words[:1] == ["!"]:
        inner = _test(words[1:])
        return None if inner is None else not inner
    if len(words) == 1:
        return words[0] != ""
    if len(words) == 2 and words[0] in ("-z", "-n"):
        return (words[1] == "") == (words[0] == "-z")
    if len(words) == 3 and words[1] in ("==", "=", "!=") and not _GLOB.search(words[2]):
        return (words[0] == words[2]) == (words[1] != "!=")
    return None
