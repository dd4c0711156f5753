"""Benchmark (not a test): the same small GPT under each pipeline schedule on local CPU ranks.

One gloo job of p*t local ranks (``ptdp.runtime.local_ranks.run_on_ranks``) runs every schedule in turn
(gpipe, 1f1b and 2bw with v=1, interleaved with v=--chunks; zb-h1 with v=1 when named in
--schedules). Per schedule it reports

* ``ours step s``: median wall time of one training step (forward_backward + reduce_gradients
  + optimizer_step) of ``ptdp.training.Trainer``, from the first rank leaving the barrier to the
  last rank finishing (ranks share CLOCK_MONOTONIC on one machine);
* ``torch step s``: the same for ``torch.distributed.pipelining`` (PipelineStage +
  ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B) running the same GPT written as plain
  nn.Modules (tools/pipeline_reference.py), loaded with our initial weights, on the same data,
  p, v, m, loss, tied-embedding gradient sum, clipping and AdamW; timed steps alternate ours/theirs so load drifts hit both.
  2bw is compared with torch's Schedule1F1B (the same p and m; torch has no 2BW). Its
  iterations run back to back, as in training (a barrier between them would be a flush): its
  step is the time between consecutive iterations' ends (the last rank's), over the timed
  ones, the drain excluded; torch's steps then run after them. zb-h1 is compared with torch's
  Schedule1F1B too (torch's zero-bubble schedules need several stages per rank);
* ``measured bubble``: from the executor trace, per rank (makespan - compute) / compute, where
  the makespan runs from the first action start to the last action end over all ranks and
  compute is the rank's action time minus the time spent waiting for receives; the mean over
  ranks is compared with the schedule's own at t_F = t_B = t_W (simulated: (p-1)/(v*m) with
  whole backwards, 2/3 of it with 1F1B's and interleaved's split cooldown, 1/3 with zb-h1);
* ``makespan ... the least its own action times allow`` (GPipe and 1F1B, v = 1): our
  forward_backward's makespan over sum_s (F_s + B_s) + (m - 1) max_s (F_s + B_s), from each
  stage's mean forward and backward compute; 1.0 means the engine adds nothing to the stages'
  own work but the pipeline's fill and drain (what is left is the model's, not the schedule's);
* ``bytes/msg``: ``P2P.bytes_sent / messages_sent`` per iteration, against b*s*h*4 (/t with
  scatter/gather).

    python tools/bench_pipeline.py --p 2 --m 8 --layers 8 --hidden 128 --seq 64 \
        --micro-batch 4 --iters 5 [--json out.json]

Each rank runs one thread (``torch.set_num_threads(1)``); with more ranks than cores the ranks
time-share and every figure (bubble above all) is distorted: the output says so, and also when
the load average already exceeds the cores. Extra lines (and the JSON) give what helps read a
noisy machine: the ratio of paired steps, CPU seconds per step over all ranks (less sensitive to
other processes than wall time), our forward_backward split into compute / receive wait / the
median gap between actions (the executor's own per-action cost), and each model alone (our
GPTChunk vs the plain modules, forward+backward of one micro-batch, no pipeline), which tells the
model's cost from the engine's. ``--tensor``/``--scatter-gather`` check the /t byte formula
(ours only). The first losses of both sides must agree: same weights, same data, same math.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

if __package__:      # python -m tools.bench_pipeline, or imported by a test
    from . import harness
    from .pipeline_reference import TorchSide, lm_loss
else:                # python tools/bench_pipeline.py (tools/harness.py says why)
    import harness
    from pipeline_reference import TorchSide, lm_loss

DEFAULT_SCHEDULES = ("gpipe", "1f1b", "interleaved", "2bw")
SCHEDULES = DEFAULT_SCHEDULES + ("zb-h1",)   # zb-h1 when named (--schedules 1f1b,zb-h1)
THEIRS = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved", "2bw": "1f1b",
          "zb-h1": "1f1b"}


# ------------------------------------------------------------------------ per-rank benchmark
def _overrides(s: dict, name: str, v: int) -> list[str]:
    return [f"model.num_layers={s['layers']}", f"model.hidden_size={s['hidden']}",
            f"model.num_heads={s['heads']}", f"model.seq_length={s['seq']}",
            f"model.vocab_size={s['vocab']}", "model.dropout=0.0", "model.arch=gpt",
            f"parallel.pipeline={s['p']}", f"parallel.tensor={s['t']}", "parallel.data=1",
            f"parallel.chunks={v}", f"parallel.scatter_gather={str(s['scatter_gather']).lower()}",
            f"schedule.name={name}", f"train.micro_batch_size={s['micro_batch']}",
            f"train.global_batch_size={s['micro_batch'] * s['m']}",
            f"train.iters={s['warmup'] + s['iters'] + (name == '2bw')}", "train.lr=1e-4",
            "train.seed=1234",
            f"train.timeout_s={s['timeout']}", "train.device=cpu"]


def _trace_and_waits(spans) -> tuple[list, list]:
    """The executor's spans as (action, start, end) and receive waits as (start, end)."""
    collected = spans.collect()
    trace = [(name, a, b) for name, cat, a, b, _ in collected if cat in ("forward", "backward")]
    waits = [(a, b) for _, cat, a, b, _ in collected if cat == "wait"]
    return trace, waits


def bench_rank(s: dict) -> list[dict]:
    """Runs on every rank: all schedules, ours and (t == 1) torch's, alternating timed steps."""
    import torch.distributed as dist

    from ptdp.config import load_config
    from ptdp.training import Trainer

    torch.set_num_threads(1)
    world = dist.get_world_size()
    out = []
    for name in s["schedules"]:
        v = s["chunks"] if name == "interleaved" else 1
        cfg = load_config(None, _overrides(s, name, v), world_size=world)
        trainer = Trainer(cfg)
        # Created on every rank in the same order (new_group is collective).
        p = s["p"]
        emb_group = dist.new_group([0, world - 1]) if s["torch"] and p > 1 else None
        theirs, error = None, None
        if s["torch"]:
            try:
                theirs = TorchSide(s, THEIRS[name], trainer, emb_group)
            except Exception as exc:  # report exactly what failed, keep benchmarking ours
                error = f"{type(exc).__name__}: {exc}"
        row = {"schedule": name, "v": v, "ours": [], "theirs": [], "ours_loss": [],
               "theirs_loss": [], "torch_error": error, "pp_rank": trainer.state.grid.pp_rank,
               "tp_rank": trainer.state.grid.tp_rank}
        if name == "2bw":
            _bench_back_to_back(trainer, s, row)
            for it in range(s["warmup"] + s["iters"]):
                if theirs is None or error is not None:
                    break
                error = _time_theirs(theirs, it, s, row)
        else:
            error = _bench_alternating(trainer, theirs, error, s, row)
        if error is not None:
            row["torch_error"], theirs = error, None
        if theirs is not None and error is None:
            row["model_only"] = _model_only(trainer, theirs, s)
        out.append(row)
        dist.barrier()
    return out


def _bench_alternating(trainer, theirs, error, s: dict, row: dict):
    """Flushing schedules: each timed step starts from a barrier, ours then theirs."""
    import torch.distributed as dist

    from ptdp.runtime.trace import Spans
    total = s["warmup"] + s["iters"]
    for it in range(total):
        timed = it >= s["warmup"]
        bytes0, msgs0 = trainer.pipeline.p2p.bytes_sent, trainer.pipeline.p2p.messages_sent
        spans = Spans(torch.device("cpu"))
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        step = trainer.step.forward_backward(it, spans)
        t1 = time.perf_counter()
        norm = trainer.step.reduce_gradients()
        t2 = time.perf_counter()
        trainer.step.optimizer_step(it, norm)
        t3, c3 = time.perf_counter(), time.process_time()
        row["ours_loss"].append(float(step.loss))
        if timed:
            row["ours"].append(_our_timing(trainer, spans, (t0, t1, t2, t3), c3 - c0, bytes0, msgs0))
        if theirs is not None and error is None:
            error = _time_theirs(theirs, it, s, row)
    return error


def _our_timing(trainer, spans, times, cpu: float, bytes0: int, msgs0: int) -> dict:
    """One timed iteration of ours: (start, forward-backward end, reduce end, step end), the
    CPU seconds, the trace with its receive waits and the p2p traffic since (bytes0, msgs0)."""
    trace, waits = _trace_and_waits(spans)
    return {**dict(zip(("t0", "t_fb", "t_reduce", "t_end"), times)), "cpu": cpu,
            "trace": trace, "waits": waits, "bytes": trainer.pipeline.p2p.bytes_sent - bytes0,
            "messages": trainer.pipeline.p2p.messages_sent - msgs0}


def _bench_back_to_back(trainer, s: dict, row: dict) -> None:
    """2BW: iterations one after the other (no barrier), each rank noting when each ends."""
    import torch.distributed as dist

    from ptdp.runtime.trace import Spans
    row["ends"] = []
    dist.barrier()
    for it in range(s["warmup"] + s["iters"] + 1):     # + the drain, not timed
        timed = s["warmup"] <= it < s["warmup"] + s["iters"]
        bytes0, msgs0 = trainer.pipeline.p2p.bytes_sent, trainer.pipeline.p2p.messages_sent
        spans = Spans(torch.device("cpu"))
        c0, t0 = time.process_time(), time.perf_counter()
        step = trainer.train_step(it, spans)
        t3, c3 = time.perf_counter(), time.process_time()
        row["ours_loss"].append(float(step.loss))
        row["ends"].append(t3)
        if timed:   # no separate reduce/update phases to time: they are actions in the stream
            row["ours"].append(_our_timing(trainer, spans, (t0, t3, t3, t3), c3 - c0, bytes0, msgs0))


def _time_theirs(theirs, it: int, s: dict, row: dict):
    """One torch.distributed.pipelining step from a barrier; returns an error text or None."""
    import torch.distributed as dist
    try:
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        # Timed with the step, as ours builds its micro-batches inside the step.
        loss = theirs.step(it, theirs.batch(it))
        t3, c3 = time.perf_counter(), time.process_time()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    row["theirs_loss"].append(loss)
    if it >= s["warmup"]:
        row["theirs"].append({"t0": t0, "t_end": t3, "cpu": c3 - c0})
    return None


def _model_only(trainer, theirs, s: dict, reps: int = 5) -> dict:
    """Forward+backward of this rank's chunks on one micro-batch, no pipeline, no messages:
    our GPTChunk vs the plain module (alternating, best of `reps`), to tell the model's cost
    from the engine's."""
    cfg = trainer.cfg.model
    batch = trainer.batches["train"].get(0, 0)
    shape = (cfg.seq_length, s["micro_batch"], cfg.hidden_size)

    def once(module, stage, ours: bool):
        x = None if stage == 0 else torch.randn(shape, requires_grad=True)
        start = time.perf_counter()
        if ours:
            out = module(x, batch)
            out = out[0] if isinstance(out, tuple) else out
        else:
            out = module(batch["tokens"] if stage == 0 else x)
            if module.is_last:
                out = lm_loss(out, batch["labels"])
        if out.dim() == 0:
            out.backward()
        else:
            out.backward(torch.ones_like(out))
        return time.perf_counter() - start

    best = {"ours": math.inf, "torch": math.inf}
    for _ in range(reps):
        best["ours"] = min(best["ours"], sum(once(trainer.state.chunks[st], st, True)
                                             for st in list(trainer.state.chunks)))
        best["torch"] = min(best["torch"], sum(once(theirs.modules[st], st, False)
                                               for st in list(trainer.state.chunks)))
    for q in list(trainer.state.params) + theirs.params:
        q.grad = None
    return best


# ------------------------------------------------------------------------ aggregation
def _median(values):
    return statistics.median(values) if values else float("nan")


def _makespan(ranks_iter: list[dict]) -> float:
    """One iteration: from the first action's start to the last action's end, over all ranks."""
    return (max(r["trace"][-1][2] for r in ranks_iter)
            - min(r["trace"][0][1] for r in ranks_iter))


def _bubble(ranks_iter: list[dict]) -> tuple[float, list[float], dict]:
    """One iteration, all pipeline ranks (tensor rank 0): mean (makespan - compute)/compute."""
    makespan = _makespan(ranks_iter)
    per_rank, detail = [], {"compute": [], "wait": [], "gaps": [], "actions": []}
    for r in ranks_iter:
        busy = sum(e - b for _, b, e in r["trace"])
        wait = sum(e - b for b, e in r["waits"])
        compute = busy - wait
        gaps = [r["trace"][i + 1][1] - r["trace"][i][2] for i in range(len(r["trace"]) - 1)]
        per_rank.append((makespan - compute) / compute)
        detail["compute"].append(compute)
        detail["wait"].append(wait)
        detail["gaps"].append(_median(gaps))
        detail["actions"].append(len(r["trace"]))
    return statistics.fmean(per_rank), per_rank, detail


def _over_ideal(ranks_iter: list[dict], m: int) -> float:
    """One iteration of a flushing schedule with one chunk per rank (GPipe, 1F1B): its makespan
    over the least any such schedule could take with these very action times,
    sum_s (F_s + B_s) + (m - 1) * max_s (F_s + B_s), where F_s and B_s are stage s's mean
    forward and backward compute (the receive waits inside an action taken out; a split
    backward's B and Wg together). 1.0: the engine adds nothing to the stages' own work but
    the fill and drain of whole backwards; 1F1B's drain, which sends input gradients before
    computing weight gradients (ptdp/pipeline/flushing.py), can go below."""
    per_stage = []
    for r in ranks_iter:
        times = {"F": [], "B": [], "W": []}
        for name, b, e in r["trace"]:
            waited = sum(min(e, we) - max(b, wb) for wb, we in r["waits"] if wb < e and we > b)
            times[name[0]].append(e - b - waited)
        backward = (sum(times["B"]) + sum(times["W"])) / len(times["B"])
        per_stage.append(statistics.fmean(times["F"]) + backward)
    return _makespan(ranks_iter) / (sum(per_stage) + (m - 1) * max(per_stage))


def aggregate(s: dict, per_rank: list[list[dict]]) -> list[dict]:
    rows = []
    world = len(per_rank)
    for k, name in enumerate(s["schedules"]):
        ranks = [per_rank[r][k] for r in range(world)]
        v = ranks[0]["v"]
        pipe = sorted((r for r in ranks if r["tp_rank"] == 0), key=lambda r: r["pp_rank"])
        ours_steps, theirs_steps, bubbles, bubbles_per_rank = [], [], [], []
        fb, post, overhead, comp, waits, cpu_ours, cpu_theirs = [], [], [], [], [], [], []
        over_ideal = []   # GPipe and 1F1B with one chunk per rank: the makespan's floor is known
        ideal_known = name in ("gpipe", "1f1b") and v == 1
        for i in range(s["iters"]):
            its = [r["ours"][i] for r in ranks]
            if "ends" in ranks[0]:   # 2bw: the period between consecutive iterations' ends
                k = s["warmup"] + i
                ours_steps.append(max(r["ends"][k] for r in ranks)
                                  - max(r["ends"][k - 1] for r in ranks))
            else:
                ours_steps.append(max(x["t_end"] for x in its) - min(x["t0"] for x in its))
            fb.append(max(x["t_fb"] for x in its) - min(x["t0"] for x in its))
            post.append(max(x["t_end"] - x["t_fb"] for x in its))
            mean, per, detail = _bubble([r["ours"][i] for r in pipe])
            if ideal_known:
                over_ideal.append(_over_ideal([r["ours"][i] for r in pipe], s["m"]))
            bubbles.append(mean)
            bubbles_per_rank.append(per)
            overhead.append(max(detail["gaps"]))
            cpu_ours.append(sum(x["cpu"] for x in its))
            comp.append(statistics.fmean(detail["compute"]))
            waits.append(statistics.fmean(detail["wait"]))
            if all(len(r["theirs"]) > i for r in ranks):
                th = [r["theirs"][i] for r in ranks]
                theirs_steps.append(max(x["t_end"] for x in th) - min(x["t0"] for x in th))
                cpu_theirs.append(sum(x["cpu"] for x in th))
        sent = sum(r["ours"][0]["bytes"] for r in ranks)
        msgs = sum(r["ours"][0]["messages"] for r in ranks)
        t = s["t"]
        formula = s["micro_batch"] * s["seq"] * s["hidden"] * 4 // (t if s["scatter_gather"] else 1)
        boundaries = s["p"] * v - 1
        errors = {r["torch_error"] for r in ranks if r["torch_error"]}
        ours_med, theirs_med = _median(ours_steps), _median(theirs_steps)
        paired = [o / th for o, th in zip(ours_steps, theirs_steps)]
        model_only = [r.get("model_only") for r in pipe if r.get("model_only")]
        ours_loss = next((r["ours_loss"] for r in ranks), [])
        theirs_loss = next((r["theirs_loss"] for r in ranks if r["theirs_loss"]
                            and not math.isnan(r["theirs_loss"][0])), [])
        rows.append({
            "schedule": name, "p": s["p"], "v": v, "m": s["m"], "t": t,
            "ours_step_s": ours_med, "torch_step_s": theirs_med,
            "ratio": ours_med / theirs_med if theirs_steps else None,
            "measured_bubble": _median(bubbles),
            "schedule_bubble": _schedule_bubble(name, s["p"], v, s["m"]),
            "torch_schedule": THEIRS[name],
            "bytes_per_msg": sent / msgs if msgs else 0, "bytes_per_msg_formula": formula,
            "bytes_per_boundary_per_iter": sent / boundaries / t if boundaries else 0,
            "bytes_per_boundary_per_iter_formula": 2 * s["m"] * formula if boundaries else 0,
            "ours_steps_s": ours_steps, "torch_steps_s": theirs_steps,
            "ratio_paired_median": _median(paired) if paired else None,
            "ratio_of_minima": min(ours_steps) / min(theirs_steps) if theirs_steps else None,
            "model_only_fwd_bwd_per_mb_s": {
                "ours": max(x["ours"] for x in model_only),
                "torch": max(x["torch"] for x in model_only)} if model_only else None,
            "ours_forward_backward_s": _median(fb), "ours_reduce_optimizer_s": _median(post),
            "ours_compute_per_rank_s": _median(comp), "ours_recv_wait_per_rank_s": _median(waits),
            "ours_gap_between_actions_median_s": _median(overhead),
            "ours_makespan_over_ideal": _median(over_ideal) if over_ideal else None,
            "ours_cpu_s_all_ranks": _median(cpu_ours), "torch_cpu_s_all_ranks": _median(cpu_theirs),
            "measured_bubble_per_rank": [_median([b[r] for b in bubbles_per_rank])
                                         for r in range(len(pipe))],
            "ours_losses": ours_loss, "torch_losses": theirs_loss,
            "torch_error": "; ".join(sorted(errors)) or None,
        })
    return rows


def _schedule_bubble(name: str, p: int, v: int, m: int) -> float:
    """The schedule's own bubble with t_F = t_B = t_W (ptdp/pipeline/timeline.py): Eq. 4.1's
    (p-1)/(v*m) less what split backwards save (1F1B's and interleaved's cooldown: 2/3 of it;
    zb-h1: 1/3); 0 without a flush."""
    from ptdp.config.catalogue import schedule_spec
    from ptdp.pipeline.timeline import simulate
    return float(simulate(name, p, v, m).bubble_fraction) if schedule_spec(name).flushing else 0.0


def _fmt(x, spec):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_table(rows: list[dict]) -> str:
    head = ["schedule", "p", "v", "m", "ours step s", "torch step s", "ratio", "measured bubble",
            "its bubble, t_F=t_B=t_W", "bytes/msg measured", "bytes/msg formula"]
    body = [[r["schedule"], str(r["p"]), str(r["v"]), str(r["m"]), _fmt(r["ours_step_s"], ".4f"),
             _fmt(r["torch_step_s"], ".4f"), _fmt(r["ratio"], ".3f"),
             _fmt(r["measured_bubble"], ".3f"), _fmt(r["schedule_bubble"], ".3f"),
             _fmt(r["bytes_per_msg"], ".0f"), str(r["bytes_per_msg_formula"])] for r in rows]
    return harness.table(head, body, sep=" | ")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=int, default=2, help="pipeline ranks")
    ap.add_argument("--m", type=int, default=8, help="micro-batches per iteration")
    ap.add_argument("--chunks", type=int, default=2, help="v for the interleaved schedule")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256,
                    help="vocabulary (a multiple of 128*t avoids padding columns)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5, help="timed iterations per schedule")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations per schedule first")
    ap.add_argument("--tensor", type=int, default=1,
                    help="t (ours only; torch.distributed.pipelining is skipped when t > 1)")
    ap.add_argument("--scatter-gather", action="store_true")
    ap.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES),
                    help=f"comma-separated, from {', '.join(SCHEDULES)}")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole job")
    ap.add_argument("--json", help="write the rows (with per-iteration detail) here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    from ptdp.runtime.local_ranks import run_on_ranks

    a = parse_args(argv)
    schedules = [x for x in a.schedules.split(",") if x]
    unknown = sorted(set(schedules) - set(SCHEDULES))
    if unknown or a.p < 2 or a.iters < 1:
        print(f"error: need --p >= 2, --iters >= 1 and schedules from {SCHEDULES} "
              f"(got p={a.p}, iters={a.iters}, unknown {unknown})", file=sys.stderr)
        return 2
    s = {"p": a.p, "m": a.m, "chunks": a.chunks, "layers": a.layers, "hidden": a.hidden,
         "heads": a.heads, "seq": a.seq, "vocab": a.vocab, "micro_batch": a.micro_batch,
         "iters": a.iters, "warmup": a.warmup, "t": a.tensor, "scatter_gather": a.scatter_gather,
         "schedules": schedules, "torch": not a.no_torch and a.tensor == 1,
         "timeout": a.timeout}
    world, cores = a.p * a.tensor, os.cpu_count() or 1
    print(f"bench_pipeline: GPT layers={a.layers} hidden={a.hidden} heads={a.heads} seq={a.seq} "
          f"vocab={a.vocab} b={a.micro_batch}; p={a.p} t={a.tensor} m={a.m}; {world} gloo ranks, "
          f"1 thread each, {cores} cores; warm-up {a.warmup}, timed {a.iters} (median)")
    if a.tensor > 1 and not a.no_torch:
        print("torch.distributed.pipelining is skipped: t > 1 would need its DTensor tensor "
              "parallelism, not the same model")
    if world > cores:
        print(f"WARNING: {world} ranks on {cores} cores: oversubscribed, ranks time-share the "
              "cores, so step times and above all the measured bubble are distorted")
    try:
        load = os.getloadavg()[0]
        if load > cores:
            print(f"WARNING: load average {load:.1f} > {cores} cores before the run: other "
                  "processes compete for the CPU; figures are noisy")
    except OSError:
        pass
    per_rank = run_on_ranks(world, bench_rank, s, timeout_s=a.timeout, threads=1)
    rows = aggregate(s, per_rank)
    print(format_table(rows))
    for r in rows:
        extra = (f"  {r['schedule']}: ours forward_backward {r['ours_forward_backward_s']:.4f}s "
                 f"(compute/rank {r['ours_compute_per_rank_s']:.4f}s, recv wait/rank "
                 f"{r['ours_recv_wait_per_rank_s']:.4f}s, median gap between actions "
                 f"{1e3 * r['ours_gap_between_actions_median_s']:.3f}ms), reduce+optimizer "
                 f"{r['ours_reduce_optimizer_s']:.4f}s; bubble per rank "
                 + ", ".join(f"{b:.3f}" for b in r["measured_bubble_per_rank"]))
        if r["ours_makespan_over_ideal"] is not None:
            extra += (f"; makespan {r['ours_makespan_over_ideal']:.3f}x the least its own "
                      f"action times allow")
        if r["ratio_paired_median"] is not None:
            extra += (f"; ratio paired-median {r['ratio_paired_median']:.3f}, of minima "
                      f"{r['ratio_of_minima']:.3f}; CPU s/step (all ranks) ours "
                      f"{r['ours_cpu_s_all_ranks']:.3f} torch {r['torch_cpu_s_all_ranks']:.3f}")
        if r["model_only_fwd_bwd_per_mb_s"]:
            mo = r["model_only_fwd_bwd_per_mb_s"]
            extra += (f"; model alone fwd+bwd/mb (slowest rank) ours {mo['ours'] * 1e3:.2f}ms "
                      f"torch {mo['torch'] * 1e3:.2f}ms")
        if r["ours_losses"] and r["torch_losses"]:
            extra += (f"; first loss ours {r['ours_losses'][0]:.6f} torch "
                      f"{r['torch_losses'][0]:.6f}")
        print(extra)
        if r["torch_error"]:
            print(f"  {r['schedule']}: torch.distributed.pipelining failed: {r['torch_error']}")
        if r["schedule"] == "2bw" and r["ratio"] is not None:
            bound = r["m"] / (r["m"] + r["p"] - 1)
            print(f"  2bw vs torch's 1F1B (same model, p, m): {r['ratio']:.3f} (target <= 0.9; "
                  f"without the flush the best is m/(m+p-1) = {bound:.3f} of a flushing step "
                  f"as fast per micro-batch)")
    if a.json:
        harness.write_json(a.json, {"settings": s, "rows": rows}, tool=__file__, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
