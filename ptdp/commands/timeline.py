"""`ptdp timeline TRACE --out timeline.png`: draw a recorded (or simulated) pipeline timeline."""

from __future__ import annotations

import sys

from ptdp.config.catalogue import DEFAULT, NAMES, schedule_spec


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "timeline", help="draw the per-rank timeline of a traced run (or of a schedule)",
        description="Draw the Gantt chart of one iteration of a trace written with "
                    "log.trace_file: one row per rank, one colour per micro-batch, forwards "
                    "light and backwards dark (as the dissertation's Figure 4.4), waits for "
                    "received tensors hatched, reductions and the optimizer step grey. Also "
                    "prints each rank's compute and wait time and the measured bubble. "
                    "Without TRACE, --schedule draws the simulated timeline of a schedule.")
    parser.add_argument("trace", nargs="?", help="Chrome-trace JSON from log.trace_file")
    parser.add_argument("--out", default="timeline.png", help="picture to write (.png, .svg, .pdf)")
    parser.add_argument("--iteration", type=int, default=None,
                        help="traced iteration to draw (default: the last one traced)")
    parser.add_argument("--chrome", metavar="JSON", default=None,
                        help="also write the drawn iteration as Chrome-trace JSON (Perfetto)")
    sim = parser.add_argument_group("simulated schedule (no TRACE)")
    sim.add_argument("--schedule", choices=NAMES,
                     help="the schedule to simulate (the no-flush ones over 3 consecutive batches)")
    sim.add_argument("--p", type=int, default=4, help="pipeline ranks")
    sim.add_argument("--v", type=int, default=1, help="chunks per rank")
    sim.add_argument("--m", type=int, default=8, help="micro-batches")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ptdp.pipeline import gantt
    try:
        lanes, title, unit, chunks = (_recorded(args) if args.trace else _simulated(args))
    except (gantt.TraceError, ValueError) as err:
        print(f"ptdp timeline: {err}", file=sys.stderr)
        return 2
    try:
        out = gantt.draw(lanes, args.out, title, unit, chunks)
    except ImportError:
        print("ptdp timeline: drawing needs matplotlib: pip install 'ptdp[plot]'", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    if args.chrome:
        print(f"wrote {gantt.write_chrome_trace(lanes, args.chrome)}")
    for line in _summary(lanes, unit):
        print(line)
    return 0


def _recorded(args):
    from ptdp.pipeline import gantt
    trace = gantt.read_trace(args.trace)
    layout = trace.get("otherData", {})
    iterations = gantt.traced_iterations(trace)
    if not iterations:
        raise gantt.TraceError(f"{args.trace} holds no traced iterations")
    iteration = args.iteration if args.iteration is not None else iterations[-1]
    p, v = layout.get("p", 1), layout.get("v", 1)
    stages = schedule_spec(layout.get("schedule", DEFAULT.name)).stage_map(p, v)
    lanes = gantt.lanes_from_trace(trace, iteration, chunks_of=stages.chunk_of)
    title = (f"{layout.get('schedule', '?')}: p={p} t={layout.get('t', '?')} "
             f"d={layout.get('d', '?')} v={v} m={layout.get('m', '?')}, iteration {iteration}")
    return lanes, title, "s", v


def _simulated(args):
    from ptdp.pipeline import gantt
    from ptdp.pipeline.timeline import simulate
    if not args.schedule:
        raise ValueError("give a TRACE file, or --schedule NAME to draw a simulated schedule")
    spec = schedule_spec(args.schedule)   # ValueError naming the schedules for a wrong one
    batches = 1 if spec.flushing else 3   # no flush: show the stream
    timeline = simulate(args.schedule, args.p, args.v, args.m, batches=batches)
    title = (f"{args.schedule} (simulated, backward = 2 x forward): p={args.p} v={args.v} "
             f"m={args.m}" + (f" x {batches} batches" if batches > 1 else "")
             + f", bubble {timeline.bubble_fraction:.3f}")
    return gantt.lanes_from_simulation(timeline), title, "forward times", args.v


def _summary(lanes, unit: str) -> list[str]:
    """Per lane: compute (forward + backward, minus the waits inside them), waits, and the
    bubble: the idle share of the span from the first forward to the last backward."""
    from ptdp.pipeline.gantt import lane_bubbles
    return [f"  {lane.label}: compute {compute:.4g} {unit}, waiting {wait:.4g} {unit}, "
            f"bubble {bubble:.3f}" for lane, (compute, wait, bubble) in zip(lanes, lane_bubbles(lanes))]
