"""Per-rank Gantt charts of pipeline iterations, from a recorded trace or a simulated schedule.

A *recorded* trace is the Chrome-trace JSON that training writes with `log.trace_file`
(`ptdp/runtime/trace.py`): one process per rank, complete events ("X") with a category (forward,
backward, wait, reduce, optimizer) and the iteration in their args. A *simulated* one comes
from `ptdp.pipeline.timeline.simulate`. Both become `Lane`s, one per rank, which `draw` turns
into a picture in the style of the dissertation's Figure 4.4: one colour per micro-batch,
forwards light and backwards dark, waits for received tensors hatched grey, reductions and the
optimizer step in grey. matplotlib is imported only to draw.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ptdp.pipeline.actions import BACKWARD, FORWARD, WEIGHT_GRAD


@dataclass
class Box:
    name: str          # "F3@s1", "wait act mb3 s0->s1", "optimizer step", ...
    category: str      # forward | backward | wait | reduce | optimizer
    start: float       # seconds (recorded) or time units (simulated), from the lane's origin
    end: float
    mb: int | None = None
    chunk: int | None = None


@dataclass
class Lane:
    label: str
    boxes: list[Box] = field(default_factory=list)


class TraceError(ValueError):
    """The file is not a trace `ptdp timeline` can read; the message says why."""


def read_trace(path: str | Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise TraceError(f"cannot read trace {path}: {err}") from err
    if not isinstance(data, dict) or "traceEvents" not in data:
        raise TraceError(f"{path} is not a Chrome trace (no traceEvents); write one with "
                         f"log.trace_file=PATH")
    return data


def traced_iterations(trace: dict) -> list[int]:
    return sorted({e["args"]["iteration"] for e in trace["traceEvents"]
                   if e.get("ph") == "X" and "iteration" in e.get("args", {})})


def lanes_from_trace(trace: dict, iteration: int, chunks_of=None) -> list[Lane]:
    """One lane per rank for `iteration`, times in seconds from the iteration's first event.

    `chunks_of(stage)` maps a global stage to its chunk (for labels when v > 1): the traced
    schedule's `StageMap.chunk_of` (ptdp/config/stages.py).
    """
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M"}
    events = [e for e in trace["traceEvents"]
              if e.get("ph") == "X" and e.get("args", {}).get("iteration") == iteration]
    if not events:
        raise TraceError(f"iteration {iteration} is not in the trace; traced iterations: "
                         f"{traced_iterations(trace)}")
    origin = min(e["ts"] for e in events)
    lanes = {}
    for e in sorted(events, key=lambda e: (e["pid"], e["ts"])):
        lane = lanes.setdefault(e["pid"], Lane(names.get(e["pid"], f"rank {e['pid']}")))
        args = e.get("args", {})
        stage = args.get("stage")
        lane.boxes.append(Box(e["name"], e.get("cat", ""), (e["ts"] - origin) / 1e6,
                              (e["ts"] + e["dur"] - origin) / 1e6, args.get("mb"),
                              chunks_of(stage) if chunks_of and stage is not None else None))
    return [lanes[pid] for pid in sorted(lanes)]


def compute_order(lane: Lane) -> list[str]:
    """The forwards and backwards of a lane in the order they ran, e.g. ["F0@s0", "B0@s0"]."""
    return [b.name for b in lane.boxes if b.category in ("forward", "backward")]


def lanes_from_simulation(timeline) -> list[Lane]:
    """Lanes of a simulated `ptdp.pipeline.timeline.Timeline` (time in its own units)."""
    kinds = {FORWARD: "forward", BACKWARD: "backward", WEIGHT_GRAD: "backward"}
    return [Lane(f"rank {rank}", [Box(str(s.action), kinds[s.action.kind], float(s.start),
                                      float(s.end), s.action.mb,
                                      timeline.stages.chunk_of(s.action.stage))
                                  for s in row if s.action.kind in kinds])   # not rank actions
            for rank, row in enumerate(timeline.ranks)]


def draw(lanes: list[Lane], out: str | Path, title: str = "", unit: str = "s",
         chunks: int = 1) -> Path:
    """Write the Gantt chart of `lanes` to `out` (PNG, SVG or PDF by its suffix)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max((b.end for lane in lanes for b in lane.boxes), default=1.0)
    fig, ax = plt.subplots(figsize=(min(24, 4 + 0.35 * _slots(lanes)), 0.9 + 0.55 * len(lanes)))
    colours = plt.get_cmap("tab10" if _micro_batches(lanes) <= 10 else "tab20")
    for row, lane in enumerate(lanes):
        y = len(lanes) - 1 - row
        for box in lane.boxes:
            _draw_box(ax, box, y, colours, chunks)
    ax.set_yticks(range(len(lanes)), [lane.label for lane in reversed(lanes)])
    ax.set_xlim(0, end)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or "pipeline timeline: forward light, backward dark, one colour per "
                          "micro-batch; hatched = waiting for a received tensor")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _draw_box(ax, box: Box, y: float, colours, chunks: int) -> None:
    width = box.end - box.start
    if box.category in ("forward", "backward"):
        colour = colours(box.mb % colours.N) if box.mb is not None else "grey"
        light = box.category == "forward"
        ax.barh(y, width, left=box.start, height=0.8, color=colour, alpha=0.45 if light else 1.0,
                edgecolor="black", linewidth=0.4)
        label = box.name.split("@")[0] if box.name else f"{'F' if light else 'B'}{box.mb}"
        if chunks > 1 and box.chunk is not None:
            label += f".{box.chunk}"
        ax.text(box.start + width / 2, y, label, ha="center", va="center", fontsize=7,
                clip_on=True)
    elif box.category == "wait":
        ax.barh(y, width, left=box.start, height=0.3, color="none", edgecolor="grey",
                hatch="////", linewidth=0.3)
    else:  # reduce, optimizer
        ax.barh(y, width, left=box.start, height=0.8,
                color="dimgrey" if box.category == "optimizer" else "silver", edgecolor="black",
                linewidth=0.4)


def lane_bubbles(lanes: list[Lane]) -> list[tuple[float, float, float]]:
    """Per lane: (compute, waiting, bubble). Compute is the forwards and backwards (weight-
    gradient passes included) minus the waits for received tensors inside them; the bubble
    is the idle share of the span from the first forward to the last backward, over compute."""
    work = [b for lane in lanes for b in lane.boxes if b.category in ("forward", "backward")]
    if not work:
        return []
    start, end = min(b.start for b in work), max(b.end for b in work)
    out = []
    for lane in lanes:
        busy = sum(b.end - b.start for b in lane.boxes if b.category in ("forward", "backward"))
        wait = sum(b.end - b.start for b in lane.boxes if b.category == "wait")
        compute = busy - wait
        out.append((compute, wait, (end - start - compute) / compute if compute > 0 else float("nan")))
    return out


def _slots(lanes: list[Lane]) -> int:
    return max((sum(b.category in ("forward", "backward") for b in lane.boxes) for lane in lanes),
               default=1)


def _micro_batches(lanes: list[Lane]) -> int:
    return len({b.mb for lane in lanes for b in lane.boxes if b.mb is not None})


def write_chrome_trace(lanes: list[Lane], out: str | Path, unit_us: float = 1e6) -> Path:
    """The lanes as Chrome-trace JSON (chrome://tracing, Perfetto), one process per lane."""
    events = []
    for pid, lane in enumerate(lanes):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": lane.label}})
        for b in lane.boxes:
            events.append({"name": b.name, "cat": b.category, "ph": "X", "pid": pid, "tid": 0,
                           "ts": b.start * unit_us, "dur": (b.end - b.start) * unit_us,
                           "args": {"mb": b.mb, "chunk": b.chunk}})
    out = Path(out)
    out.write_text(json.dumps({"traceEvents": events}))
    return out
