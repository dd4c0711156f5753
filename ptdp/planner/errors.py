"""The planner's one exception type: bad input the user can fix (the CLI exits with code 2)."""

from __future__ import annotations


class PlanError(ValueError):
    """A problem with the planner's input; the message names what is wrong and how to fix it."""
