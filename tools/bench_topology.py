#!/usr/bin/env python
"""Benchmark (not a test): layouts on 2 simulated nodes x 4 ranks joined by a slow link.

Brings up a cluster with tools/simcluster.sh (two network namespaces, `tc tbf` at --rate on
each node's link; ranks inside a node use loopback), trains a small GPT with each layout
below by launching tools/pretrain_gpt.sh on both nodes exactly as on a cluster, and compares
the measured step time with the planner's prediction (ptdp.planner.cost_model.predict) for
a hardware profile of this cluster:

* intra-node: `ptdp profile` run inside node 0 (layer times for every t; collectives, p2p
  and tensor-parallel layers with all 8 ranks busy, since the two nodes share the cores);
* inter-node: measured here over the namespace link by a torchrun job across both nodes
  (`--link-worker`): the 4 cross-node rank pairs exchange at once, as the pipeline and the
  data-parallel all-reduce do, fitted as latency + bytes / bandwidth like `ptdp profile`.
  The node's whole link is 4 x a pair's share (nics_per_node = 1).
* the two nodes share this machine's cores: compute_units = cores / 2 per node.

    sudo python tools/bench_topology.py --rate 200mbit --iters 6 --repeat 3 --json bench/topology.json

Layouts: t inside a node with p across (p, t, d) = (2, 4, 1), with and without
scatter/gather, under 1F1B and interleaved (v = 2); t across nodes (1, 8, 1); data-parallel
across nodes (1, 4, 2). Step time = median over the iterations after the first of each run,
then the median over --repeat runs (the fastest run is printed too). The load average at the
start and end is printed: other processes on the box inflate compute, not the link.
Needs root and iproute2 (tools/simcluster.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

if __package__:      # python -m tools.bench_topology, or imported by a test
    from . import harness
else:                # python tools/bench_topology.py (tools/harness.py says why)
    import harness

ROOT = Path(__file__).resolve().parents[1]   # the checkout: tools/simcluster.sh, configs/

SIMCLUSTER = ROOT / "tools/simcluster.sh"
NAME = "ptdpsimbench"
NODES, PER_NODE = 2, 4
MODEL = {"arch": "gpt", "num_layers": 4, "hidden_size": 256, "num_heads": 8, "seq_length": 128,
         "vocab_size": 1000, "dropout": 0.0}
GLOBAL_BATCH, MICRO_BATCH = 8, 1
SIZES = [2**12, 2**15, 2**17, 2**19]     # float32 elements for the link measurement
TOLERANCE = 0.15


def layouts():
    from ptdp.planner.cost_model import Layout
    base = Layout(2, 4, 1, 1, MICRO_BATCH, "1f1b", "none", False)
    return {   # name -> (layout, what it shows)
        "t4-in-node p2-across": (base, "tensor inside a node, pipeline across"),
        "t4-in-node p2-across sg": (replace(base, scatter_gather=True), "+ scatter/gather"),
        "t4-in-node p2-across v2": (replace(base, chunks=2, schedule="interleaved"), "interleaved 1F1B"),
        "t8-across": (Layout(1, 8, 1, 1, MICRO_BATCH, "1f1b", "none", False), "tensor across nodes"),
        "t4-in-node d2-across": (Layout(1, 4, 2, 1, MICRO_BATCH, "1f1b", "none", False),
                                 "data-parallel all-reduce across nodes"),
    }


# --------------------------------------------------------------------------------------------
# The cluster
# --------------------------------------------------------------------------------------------

def sim(*args, check=True):
    return subprocess.run([str(SIMCLUSTER), *map(str, args)], check=check, text=True,
                          env={**os.environ, "SIMCLUSTER_NAME": NAME}, timeout=120)


def node_env(node: int, port: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(SIMCLUSTER_NAME=NAME, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", NNODES=str(NODES),
               NODE_RANK=str(node), MASTER_ADDR=f"{NAME}-n0", MASTER_PORT=str(port),
               GPUS_PER_NODE=str(PER_NODE))
    return env


def run_on_nodes(command: list[str], port: int, timeout_s: float, logs: Path) -> None:
    """`command` on every node at once (inside its namespace); raises naming a failed node."""
    jobs = [subprocess.Popen([str(SIMCLUSTER), "run", str(n), *command], cwd=ROOT,
                             env=node_env(n, port), stdout=(logs / f"node{n}.log").open("w"),
                             stderr=subprocess.STDOUT) for n in range(NODES)]
    deadline = time.monotonic() + timeout_s
    try:
        for job in jobs:
            job.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if any(job.poll() is None for job in jobs):
            for n in range(NODES):   # torchrun's workers run in sessions of their own
                sim("kill", n, check=False)
            for job in jobs:
                job.wait()
    for n, job in enumerate(jobs):
        if job.returncode != 0:
            tail = (logs / f"node{n}.log").read_text()[-2000:]
            raise RuntimeError(f"node {n} exited with {job.returncode}:\n{tail}")


# --------------------------------------------------------------------------------------------
# Inter-node link: runs on every rank of a 2 x 4 torchrun job (--link-worker)
# --------------------------------------------------------------------------------------------

def link_worker(out: str, iters: int) -> None:
    """Rank r and r + 4 (one per node) exchange `n` floats, all 4 pairs at once; and each
    pair all-reduces (a 2-rank ring, as d = 2 across nodes). Rank 0 writes the samples."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    pairs = [dist.new_group([r, r + PER_NODE]) for r in range(PER_NODE)]
    mine = pairs[rank % PER_NODE]
    peer = (rank + PER_NODE) % (2 * PER_NODE)
    samples = {"exchange": [], "all_reduce": []}
    for n in SIZES:
        send, recv = torch.ones(n), torch.empty(n)
        for kind in samples:
            times = []
            for i in range(iters + 1):
                dist.barrier()
                start = time.perf_counter()
                if kind == "exchange":   # both directions at once, like 1F1B's steady state
                    ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
                    for req in dist.batch_isend_irecv(ops):
                        req.wait()
                else:
                    dist.all_reduce(send, group=mine)
                dist.barrier()   # until every pair is done: they share the link
                if i:   # the first is a warm-up
                    times.append(time.perf_counter() - start)
            samples[kind].append((n * 4, statistics.median(times)))
    if rank == 0:
        Path(out).write_text(json.dumps(samples))
    dist.barrier()
    dist.destroy_process_group()


def measure_link(tmp: Path, iters: int) -> dict:
    """Per-pair latency and bandwidth of the inter-node link with 4 pairs sharing it."""
    from ptdp.profiler.collectives import fit_latency_bandwidth
    out = tmp / "link.json"
    cmd = ["sh", "-c", f'exec "{sys.executable}" -m torch.distributed.run --nnodes {NODES} '
           f'--node-rank "$NODE_RANK" --nproc-per-node {PER_NODE} --master-addr "$MASTER_ADDR" '
           f'--master-port "$MASTER_PORT" "{Path(__file__).resolve()}" --link-worker {out} '
           f'--link-iters {iters}']
    run_on_nodes(cmd, 29690, 300, tmp)
    samples = json.loads(out.read_text())
    slope, latency = fit_latency_bandwidth(samples["exchange"])
    # a 2-rank ring all-reduce moves 2(n-1)/n = 1 buffer each way in 2(n-1) = 2 steps
    ar_slope, ar_latency = fit_latency_bandwidth(samples["all_reduce"])
    return {"pair_bandwidth_GBps": 1e-9 / slope, "pair_latency_us": latency * 1e6,
            "pair_all_reduce_GBps": 1e-9 / ar_slope, "all_reduce_latency_us": ar_latency / 2 * 1e6,
            "samples": samples}


# --------------------------------------------------------------------------------------------
# Profile and predictions
# --------------------------------------------------------------------------------------------

def model_yaml(tmp: Path) -> Path:
    import yaml
    path = tmp / "model.yaml"
    path.write_text(yaml.safe_dump({"model": {**MODEL, "ffn_hidden_size": 4 * MODEL["hidden_size"]}}))
    return path


def cluster_profile(tmp: Path, link: dict, iters: int):
    """`ptdp profile` inside node 0, plus the measured inter-node link.

    The simulated nodes share this machine's cores: while a job runs, a node's 4 ranks
    compute and communicate next to the other node's 4. So the profile measures busy worlds
    of up to all 8 ranks, and what it saw with 8 busy is what a node of this cluster sees
    (its rows for 8 ranks stand for a busy node of 4)."""
    from ptdp.hardware import load_hardware
    out = tmp / "cluster.yaml"
    ranks = NODES * PER_NODE
    subprocess.run([str(SIMCLUSTER), "run", "0", sys.executable, "-m", "ptdp", "profile",
                    str(model_yaml(tmp)), "--out", str(out), "--micro-batches", str(MICRO_BATCH),
                    "--tensor", "1,2,4,8", "--ranks", str(ranks), "--ranks-per-node",
                    str(PER_NODE), "--threads", "1", "--iters", str(iters)],
                   check=True, cwd=ROOT, env=node_env(0, 0), timeout=1800)
    hw = load_hardware(str(out))
    measured = hw.measured
    whole = next(row for row in measured["busy"] if row["ranks"] == ranks)
    measured["busy"] = [{**whole, "ranks": PER_NODE}]
    measured["tensor_layers"] = [{**row, "world": PER_NODE} for row in measured["tensor_layers"]
                                 if row["world"] == ranks and row["tensor"] <= PER_NODE]
    hw.name = f"simcluster-{NODES}x{PER_NODE}"
    hw.inter_node_bandwidth_GBps = link["pair_bandwidth_GBps"] * PER_NODE
    hw.inter_node_latency_us = link["pair_latency_us"]
    hw.nics_per_node = 1
    hw.compute_units = max(1, len(os.sched_getaffinity(0)) // NODES)
    return hw


def predictions(hw) -> dict:
    from ptdp.config import config_from_dict
    from ptdp.planner.compute import ModelShape
    from ptdp.planner.cost_model import Workload, predict
    shape = ModelShape.from_config(config_from_dict(
        {"model": {**MODEL, "ffn_hidden_size": 4 * MODEL["hidden_size"]}}).model)
    work = Workload(shape, GLOBAL_BATCH, "fp32", PER_NODE)
    return {name: predict(hw, work, lay) for name, (lay, _) in layouts().items()}


# --------------------------------------------------------------------------------------------
# Training runs
# --------------------------------------------------------------------------------------------

def overrides(layout, iters: int, metrics: Path) -> list[str]:
    model = [f"model.{k}={v}" for k, v in MODEL.items()]
    return model + [
        f"parallel.pipeline={layout.pipeline}", f"parallel.tensor={layout.tensor}",
        f"parallel.data={layout.data}", f"parallel.chunks={layout.chunks}",
        f"parallel.scatter_gather={str(layout.scatter_gather).lower()}",
        f"schedule.name={layout.schedule}", f"train.micro_batch_size={layout.micro_batch}",
        f"train.global_batch_size={GLOBAL_BATCH}", f"train.iters={iters}", "train.device=cpu",
        "train.precision=fp32", "train.lr_warmup_iters=0", "train.timeout_s=300",
        "log.progress=false", "log.interval=1000", f"log.metrics_file={metrics}"]


def measure(layout, iters: int, port: int, tmp: Path) -> float:
    """Median step seconds of one run, the first iteration left out."""
    metrics = tmp / f"metrics-{port}.jsonl"
    run_on_nodes([str(ROOT / "tools/pretrain_gpt.sh"), "configs/gpt_tiny.yaml",
                  *overrides(layout, iters, metrics)], port, 900, tmp)
    steps = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()]
    return statistics.median(steps[1:])


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="200mbit", help="inter-node link rate (tc), default 200mbit; 'none': unlimited "
                    "(a reference: the same runs without the slow link)")
    ap.add_argument("--iters", type=int, default=6, help="training iterations per run")
    ap.add_argument("--repeat", type=int, default=3, help="runs per layout (median reported)")
    ap.add_argument("--profile-iters", type=int, default=5, help="`ptdp profile --iters`")
    ap.add_argument("--layouts", default=None, help="comma-separated subset of the layouts")
    ap.add_argument("--json", default=None, help="write the table and settings here")
    ap.add_argument("--link-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--link-iters", type=int, default=5, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.link_worker:
        link_worker(a.link_worker, a.link_iters)
        return 0
    chosen = layouts()
    if a.layouts:
        unknown = [n for n in a.layouts.split(",") if n not in chosen]
        if unknown:
            ap.error(f"unknown layout(s) {unknown}; choose from {list(chosen)}")
        chosen = {n: chosen[n] for n in a.layouts.split(",")}
    if os.geteuid() != 0:
        print("bench_topology.py: error: needs root (tools/simcluster.sh makes network namespaces)",
              file=sys.stderr)
        return 2

    start_load = load_average()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # so `finally` takes the cluster down
    sim("up", NODES, *(["--inter-node-rate", a.rate] if a.rate != "none" else []))
    try:
        with tempfile.TemporaryDirectory(prefix="bench_topology-") as tmp_name:
            tmp = Path(tmp_name)
            link = measure_link(tmp, a.profile_iters)
            print(f"inter-node link at {a.rate}: {link['pair_bandwidth_GBps'] * 1e3:.1f} MB/s per "
                  f"cross-node pair with {PER_NODE} pairs at once ({link['pair_bandwidth_GBps'] * PER_NODE * 8e3:.0f} "
                  f"Mbit/s per node), latency {link['pair_latency_us']:.0f} us", flush=True)
            hw = cluster_profile(tmp, link, a.profile_iters)
            print(f"intra-node (ptdp profile, {NODES * PER_NODE} ranks busy): all-reduce "
                  f"{hw.intra_node_bandwidth_GBps:.2f} GB/s bus, p2p "
                  f"{hw.measured['p2p']['bandwidth_GBps']:.2f} GB/s", flush=True)
            preds = predictions(hw)
            rows = []
            print(f"\n{'layout':<26} {'(p,t,d,v) sg':<14} {'pred_s':>7} {'meas_s':>7} {'min_s':>7} "
                  f"{'err':>7}  what", flush=True)
            for i, (name, (lay, what)) in enumerate(chosen.items()):
                runs = [measure(lay, a.iters, 29700 + 10 * i + r, tmp) for r in range(a.repeat)]
                meas, pred = statistics.median(runs), preds[name]
                err = pred.step_time_s / meas - 1
                rows.append({"layout": name, "p": lay.pipeline, "t": lay.tensor, "d": lay.data,
                             "v": lay.chunks, "schedule": lay.schedule,
                             "scatter_gather": lay.scatter_gather, "what": what,
                             "measured_step_s": meas, "runs_s": runs,
                             "predicted_step_s": pred.step_time_s, "error": err,
                             "predicted_breakdown_s": pred.time})
                shape = f"({lay.pipeline},{lay.tensor},{lay.data},{lay.chunks}) {'on' if lay.scatter_gather else 'off'}"
                print(f"{name:<26} {shape:<14} {pred.step_time_s:>7.3f} {meas:>7.3f} "
                      f"{min(runs):>7.3f} {err:>+7.1%}  {what}", flush=True)
    finally:
        sim("down", check=False)
    end_load = load_average()
    worst = max(abs(r["error"]) for r in rows)
    print(f"\nworst |error| {worst:.1%} (goal {TOLERANCE:.0%}); load average {start_load} at the "
          f"start, {end_load} at the end, {os.cpu_count()} cores on {platform.node()}")
    if a.json:
        harness.write_json(a.json, {
            "settings": {"rate": a.rate, "iters": a.iters, "repeat": a.repeat, "model": MODEL,
                         "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH,
                         "nodes": NODES, "ranks_per_node": PER_NODE,
                         "load_average": [start_load, end_load], "cores": os.cpu_count()},
            "link": link, "profile": hw.to_dict(), "rows": rows}, tool=__file__, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
