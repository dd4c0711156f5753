"""Pipeline timelines: a schedule played out by name (``simulate``) and drawn as text
(``render_ascii``, like the dissertation's Figs. 4.3/4.4). The simulator itself is
ptdp/pipeline/simulation.py; pictures of recorded or simulated runs are ptdp/pipeline/gantt.py.
"""

from __future__ import annotations

from ptdp.config.catalogue import schedule_spec
from ptdp.pipeline.actions import Action
from ptdp.pipeline.schedules import build_all
from ptdp.pipeline.simulation import Timeline, simulate_lists


def simulate(name: str, p: int, v: int, m: int, t_f=1.0, t_b=2.0, t_comm=0.0,
             batches: int = 1, t_w=None) -> Timeline:
    """Simulate schedule ``name`` on ``p`` ranks with ``v`` chunks each and ``m`` micro-batches
    per batch, over ``batches`` consecutive batches (the timeline's ``m`` is all of them)."""
    return simulate_lists(build_all(name, p, v, m, batches), p, v, m * batches, t_f, t_b, t_comm,
                          name=name, t_w=t_w, placement=schedule_spec(name).placement)


def render_ascii(timeline: Timeline, width: int | None = None) -> str:
    """One row per rank, time to the right, like Figs. 4.3/4.4.

    Each action is a box ``F3   |`` whose length is proportional to its duration; ``.`` is idle
    time (the bubble). With v>1 the label carries the chunk: ``F3.1`` is micro-batch 3, chunk 1.
    ``width`` is the number of columns for the whole makespan; by default it is chosen so that
    the shortest action fits its label.
    """
    slots = [s for row in timeline.ranks for s in row]
    if not slots:
        return ""

    def label(a: Action) -> str:
        chunk = "" if timeline.v == 1 else f".{timeline.stages.chunk_of(a.stage)}"
        return f"{a.kind}{a.mb}{chunk}"

    if width is None:
        shortest = min(s.end - s.start for s in slots if s.end > s.start)
        longest_label = max(len(label(s.action)) for s in slots)
        width = int(round(timeline.makespan / shortest)) * (longest_label + 1)
    scale = width / timeline.makespan
    lines = [
        f"{timeline.name}: p={timeline.p} v={timeline.v} m={timeline.m}  "
        f"makespan={float(timeline.makespan):g}  bubble={float(timeline.bubble_fraction):.3f}"
    ]
    for rank, row in enumerate(timeline.ranks):
        cells = ["."] * width
        for slot in row:
            lo, hi = round(slot.start * scale), round(slot.end * scale)
            if hi <= lo:
                continue
            box = label(slot.action)[: hi - lo - 1].ljust(hi - lo - 1) + "|"
            cells[lo:hi] = box[-(hi - lo):]
        lines.append(f"rank {rank:<{len(str(timeline.p - 1))}} |" + "".join(cells))
    return "\n".join(lines)
