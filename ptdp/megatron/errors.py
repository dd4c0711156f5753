"""The one error of Megatron conversion and its two helpers; no torch, so that translating
Megatron arguments (`ptdp check`'s hints, ptdp/megatron/translate.py) needs no model code."""

from __future__ import annotations


class MegatronConversionError(ValueError):
    """A Megatron checkpoint, argument or file that cannot be converted faithfully; one line."""


def argument(args, name: str, default=None):
    """A Megatron argument (or megatron-core config field) of `args`, or `default` where it is
    absent or None."""
    value = getattr(args, name, default)
    return default if value is None else value


def require(condition: bool, message: str) -> None:
    if not condition:
        raise MegatronConversionError(message)
