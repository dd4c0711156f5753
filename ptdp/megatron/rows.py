"""One row of the Megatron-LM argument table (ptdp/megatron/arguments.py, and its MoE rows in
ptdp/megatron/moe_flags.py). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Arg:
    flag: str                 # Megatron's spelling; "--moe-*" covers every flag so prefixed
    key: str | None           # the ptdp key it sets (None: nothing, e.g. ignored)
    kind: str                 # what it usually is: exact | approximate | ignored | refused
    convert: Callable[[Any, dict], Any] | None = None   # None: the value as given
    note: str = ""            # the difference, or why it is not mapped
    nargs: int | str = 1      # 0: a switch, 1: one value, 3: three, "*": a list
    default: Any = None       # Megatron's default, written when absent (None: nothing to write)
    model: bool = False       # it shapes the model (as every model.* key does): refusing it
                              # would translate another model, so the translation stops

    @property
    def family(self) -> bool:
        return self.flag.endswith("*")

    @property
    def changes_model(self) -> bool:
        return self.model or (self.key or "").startswith("model.")

