"""The "did you mean" hint every unknown name gets (keys, sections, schedules, model families)."""

from __future__ import annotations

import difflib


def suggest(word: str, options) -> str:
    """` (did you mean 'x'?)` for the closest of `options` to `word`, or ''."""
    close = difflib.get_close_matches(str(word), list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
