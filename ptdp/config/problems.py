"""One line per configuration problem, collected so a user sees every mistake in one go
(ptdp/config/validation.py and the run-length checks, ptdp/config/run_length.py)."""

from __future__ import annotations

from ptdp.config.hints import suggest
from ptdp.config.schema import ConfigError


class Problems:
    """Collects one line per problem, so a user sees every mistake in one go."""

    def __init__(self):
        self.lines: list[str] = []

    def require(self, cond: bool, message: str) -> bool:
        if not cond:
            self.lines.append(message)
        return bool(cond)

    def choice(self, value: str, options: tuple, key: str) -> bool:
        return self.require(value in options, f"{key}: '{value}' is not one of {', '.join(options)}"
                                              f"{suggest(str(value), list(options))}")

    def positive(self, value, key: str, strict: bool = True, hint: str = "") -> bool:
        ok = value > 0 if strict else value >= 0
        bound = "positive" if strict else ">= 0"
        return self.require(ok, f"{key} must be {bound}, got {value}{hint}")

    def parse(self, fn, *args):
        """fn(*args), recording its ConfigError; None when it failed."""
        try:
            return fn(*args)
        except ConfigError as err:
            self.lines.extend(err.errors)
            return None
