"""Sliding-window attention's keys (model.sliding_window, model.sliding_window_layers): their
checks, and the note for a window that changes nothing at the run's length. What the window
means is models/attention.py's (Hugging Face's `sliding_window_causal`)."""

from __future__ import annotations

from ptdp.config.models import MODEL_FAMILIES, family_names
from ptdp.config.problems import Problems
from ptdp.config.schema import ModelConfig


def check_window(m: ModelConfig, out: Problems) -> None:
    window, layers = m.sliding_window, m.sliding_window_layers
    if window is None:
        out.require(layers is None, f"model.sliding_window_layers={layers} needs "
                                    f"model.sliding_window (the window those layers use)")
        return
    out.require(window >= 1, f"model.sliding_window must be >= 1 or null (no window), got {window}")
    family = MODEL_FAMILIES.get(m.arch)   # None when unknown: validation says so
    out.require(family is None or family.causal, f"model.sliding_window applies to model.arch="
                                 f"{family_names(lambda f: f.causal)} only (causal decoders); "
                                 f"model.arch={m.arch} attends both ways")
    if layers is not None:
        out.require(len(layers) > 0, "model.sliding_window_layers=[] makes no layer local, so "
                                     "model.sliding_window would do nothing (null = every layer)")
        wrong = [i for i in layers if not 0 <= i < m.num_layers]
        out.require(not wrong, f"model.sliding_window_layers: {wrong} not among the "
                               f"{m.num_layers} layers (0-based, 0 .. {m.num_layers - 1})")
        out.require(len(set(layers)) == len(layers),
                    f"model.sliding_window_layers lists a layer twice: {layers}")


def window_notes(m: ModelConfig) -> list[str]:
    """A window at least the sequence long hides nothing at this length: accepted, noted."""
    if m.sliding_window is None or m.sliding_window < m.seq_length:
        return []
    return [f"model.sliding_window={m.sliding_window} >= model.seq_length={m.seq_length}: "
            f"every query already sees all the keys before it, so the window changes nothing "
            f"at this length (it would past {m.sliding_window} tokens)"]
