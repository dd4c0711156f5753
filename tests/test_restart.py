"""A job that looks after itself: the launch script restarts it after a failure, it resumes from
its newest checkpoint, and the metrics file ends as if nothing had happened.

* One real job of 2 CPU ranks (p = 2, dropout on) under tools/pretrain_gpt.sh with
  MAX_RESTARTS=2: one rank is killed (SIGKILL), the job restarts, later one rank is stopped
  (SIGSTOP), the hang detector names it, the job restarts again; it ends with exit 0 by itself
  and its per-iteration losses equal an uninterrupted run's.
* The restart loop's decisions, with a stand-in for torchrun (TORCHRUN): a hang is restarted,
  a configuration error and a divergence are not, restarts run out.
* checkpoint.load=auto; asynchronous saves write the same files as synchronous ones, and a rank
  killed while they are written leaves the previous checkpoint to resume from, exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ptdp.checkpoint.layout import find_checkpoint, iteration_dir_name
from ptdp.metrics.log import read_metrics
from ptdp.runtime.local_ranks import RankFailure, run_on_ranks
from tests.deadline import within
from tests.equivalence import TINY
from tests.test_watchdog import _continue_when_named
from tools import jobs
from tools.jobs import ROOT, SCRIPT, env as _env, wait_for_iteration as _wait_for_iteration

ITERS = 30
# train.timeout_s=3: the stopped rank is named after a stall of 2.4 s (tests/test_watchdog.py's
# STALL_TIMEOUT_S says why that is enough), the job's cores idle meanwhile.
JOB = ["parallel.pipeline=2", f"train.iters={ITERS}", "checkpoint.save_interval=10",
       "checkpoint.load=auto", "model.dropout=0.1", "train.timeout_s=3", "log.progress=false",
       "log.interval=1000"]


# --------------------------------------------------------------------------------------------
# A real job, killed and stopped
# --------------------------------------------------------------------------------------------

def _reference_losses(overrides: list[str]) -> list[float]:
    from ptdp.config import load_config
    from ptdp.training import Trainer
    cfg = load_config(str(ROOT / "configs/gpt_tiny.yaml"), overrides,
                      world_size=dist.get_world_size())
    return [record["loss"] for record in Trainer(cfg).train()]


@pytest.fixture(scope="module")
def failed_twice(tmp_path_factory):
    root = tmp_path_factory.mktemp("restart")
    metrics = root / "metrics.jsonl"
    overrides = JOB + [f"checkpoint.dir={root / 'ck'}", f"log.metrics_file={metrics}"]
    uninterrupted = [o for o in JOB if not o.startswith("checkpoint.")]
    # GPUS_PER_NODE given: the script does not import torch to count devices (a launch's
    # device detection is tests/test_configs.py's; this is about its restarts).
    job = jobs.start(["bash", str(SCRIPT), str(ROOT / "configs/gpt_tiny.yaml"), *overrides],
                     root, MAX_RESTARTS="2", GPUS_PER_NODE="2")
    lines, stopped = [], []
    reader = threading.Thread(target=_continue_when_named, args=(job, stopped, lines),
                              daemon=True)
    reader.start()
    # The uninterrupted run, beside the job (whose start-ups and waits leave cores idle).
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(run_on_ranks, 2, _reference_losses, uninterrupted,
                                timeout_s=within(120))
        _kill_then_stop(job, metrics, stopped)
        reader.join(timeout=10)
        reference = reference.result()[0]
    return {"rc": job.returncode, "lines": lines, "reference": reference,
            "metrics": read_metrics(metrics)}


def _kill_then_stop(job, metrics: Path, stopped: list) -> None:
    """Kill rank 0 in iteration ~14, stop rank 1 in iteration ~24 of the restarted job; wait
    until the job ends. (Each is 3 iterations past a checkpoint and 7 before the next.)"""
    try:
        _wait_for_iteration(metrics, job, 13, timeout=within(120))
        os.kill(jobs.pid_of_rank(0, job.marker), signal.SIGKILL)  # a crash in iteration ~14
        _wait_for_iteration(metrics, job, 23, timeout=within(120))  # restarted, past it
        stopped.append(jobs.pid_of_rank(1, job.marker))
        os.kill(stopped[0], signal.SIGSTOP)                       # a hang in iteration ~24
        job.wait(timeout=within(240))
    finally:
        jobs.stop(job)   # its workers too, had the test failed half-way


def test_the_job_restarts_twice_and_ends_by_itself(failed_twice):
    out = "\n".join(failed_twice["lines"])
    assert failed_twice["rc"] == 0, out
    restarts = [line for line in failed_twice["lines"] if "restart " in line and " of 2" in line]
    assert len(restarts) == 2, out
    assert "a crash" in restarts[0] and "a hang or a lost rank" in restarts[1], restarts
    assert any(line.startswith("ptdp train: rank(s) stopped making progress: rank 1")
               for line in failed_twice["lines"]), out
    resumed = [line for line in failed_twice["lines"]
               if line.startswith("ptdp train: ") and "resuming from" in line]
    assert len(resumed) == 2 and "iter_0000010" in resumed[0], resumed


def test_every_iteration_is_logged_once_with_the_uninterrupted_loss(failed_twice):
    records = failed_twice["metrics"]
    assert [r["iter"] for r in records] == list(range(1, ITERS + 1))
    assert [r["loss"] for r in records] == failed_twice["reference"]


# --------------------------------------------------------------------------------------------
# The restart loop's decisions (a stand-in for torchrun)
# --------------------------------------------------------------------------------------------

# Attempt n exits with the n-th code of PLAN ("crash": killed, no code left); 0 ends well.
FAKE_TORCHRUN = """
import os, sys
plan = os.environ["PLAN"].split(",")
attempt = int(os.environ["PTDP_RESTART"])
with open(os.environ["LOG"], "a") as log:
    log.write(f"{attempt} {' '.join(a for a in sys.argv[1:] if a.startswith('checkpoint.'))}\\n")
code = plan[min(attempt, len(plan) - 1)]
if code == "0":
    sys.exit(0)
if code != "crash":
    for rank in range(2):
        open(os.path.join(os.environ["PTDP_EXIT_DIR"], f"rank{rank}"), "w").write(code + "\\n")
sys.exit(1)
"""


PLANS = [
    ("4,crash,0", 3, 0, 3),       # a hang, then a crash: both restarted
    ("2", 3, 2, 1),               # a configuration error: not restarted
    ("3", 3, 3, 1),               # divergence: not restarted
    ("crash", 2, 1, 3),           # the restarts run out
]


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """Every launch of the script below, started at once (each spends seconds in its
    `ptdp check`, mostly one core's work): {plan, or "itres": (exit code, stderr, the
    attempts' log lines)}."""
    root = tmp_path_factory.mktemp("loop")
    fake = root / "fake_torchrun.py"
    fake.write_text(FAKE_TORCHRUN)
    started = {}
    for plan, max_restarts, _, _ in PLANS:
        log = root / f"attempts-{plan}.log"
        started[plan] = (log, _script(root, "train.iters=2", MAX_RESTARTS=str(max_restarts),
                                      TORCHRUN=f"{sys.executable} {fake}", PLAN=plan,
                                      LOG=str(log)))
    started["itres"] = (None, _script(root, "train.itres=2", MAX_RESTARTS="3"))
    out = {}
    try:
        for name, (log, proc) in started.items():
            _, stderr = proc.communicate(timeout=within(120))
            out[name] = (proc.returncode, stderr,
                         log.read_text().splitlines() if log and log.exists() else [])
    finally:
        for _, proc in started.values():
            jobs.stop(proc)
    return out


def _script(root: Path, override: str, **extra) -> subprocess.Popen:
    """The launch script in a folder of its own under `root` (its outputs apart). Given
    GPUS_PER_NODE, it does not import torch to count devices (a second of CPU per launch, five
    launches at once): these tests are about its restart loop."""
    cwd = root / f"run{len(list(root.glob('run*')))}"
    cwd.mkdir()
    return subprocess.Popen(["bash", str(SCRIPT), str(ROOT / "configs/gpt_tiny.yaml"), override],
                            env=_env(GPUS_PER_NODE="2", **extra), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.parametrize("plan,max_restarts,rc,attempts", PLANS)
def test_the_loop_restarts_what_is_worth_it(scripts, plan, max_restarts, rc, attempts):
    returncode, stderr, log = scripts[plan]
    assert returncode == rc, stderr
    assert [line.split()[0] for line in log] == [str(i) for i in range(attempts)]
    if rc in (2, 3):
        assert "not restarting" in stderr


def test_a_config_error_ends_the_script_before_any_attempt(scripts):
    returncode, stderr, _ = scripts["itres"]
    assert returncode == 2
    assert "unknown key 'train.itres' (did you mean 'iters'?)" in stderr
    assert "restart" not in stderr


# --------------------------------------------------------------------------------------------
# checkpoint.load=auto and asynchronous saves (a spawned job of 2 ranks, killed; then one more)
# --------------------------------------------------------------------------------------------

SAVES = TINY + ["parallel.pipeline=2", "model.dropout=0.1", "train.iters=6",
                "checkpoint.save_interval=2", "log.progress=false"]


def _trainer(overrides: list[str]):
    from ptdp.config import load_config
    from ptdp.training import Trainer
    return Trainer(load_config(None, SAVES + overrides, world_size=dist.get_world_size()))


def _saved_tensors(directory: Path) -> dict:
    return {f.name: torch.load(f, weights_only=True) for f in sorted(directory.glob("*.pt"))}


def _same(a, b) -> bool:
    """Equal to the bit, through nested dicts, lists and tensors."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _kill_rank1_in_second_background_write():
    """PendingSave.write that kills rank 1 once it has written one file of the save of
    iteration 4 (the other rank finishes its own): a crash in the middle of the background
    writes."""
    from ptdp.checkpoint import save as checkpoint_save
    write = checkpoint_save.PendingSave.write

    def dying_write(self):
        if dist.get_rank() == 1 and self.final.name == iteration_dir_name(4):
            path, obj = next(iter(self.files.items()))
            checkpoint_save.save_durably(obj, path)
            os.kill(os.getpid(), signal.SIGKILL)
        write(self)

    checkpoint_save.PendingSave.write = dying_write


def async_job(root: str) -> dict:
    """checkpoint.load=auto from nothing and from a checkpoint; the same run saved
    synchronously and in the background."""
    root = Path(root)
    out = {}
    fresh = _trainer([f"checkpoint.dir={root / 'auto'}", "checkpoint.load=auto",
                      "train.iters=2"])
    out["fresh start"] = fresh.iteration
    fresh.train()
    out["auto resumes at"] = _trainer([f"checkpoint.dir={root / 'auto'}",
                                       "checkpoint.load=auto"]).iteration
    for kind in ("sync", "async"):
        trainer = _trainer([f"checkpoint.dir={root / kind}",
                            f"checkpoint.async_save={str(kind == 'async').lower()}"])
        out[f"{kind} losses"] = [r["loss"] for r in trainer.train()]
    return out


def killed_job(root: str) -> None:
    _kill_rank1_in_second_background_write()
    _trainer([f"checkpoint.dir={Path(root) / 'killed'}", "checkpoint.async_save=true"]).train()


def resume_and_async_jobs(root: str) -> dict:
    """The killed job resumed, then async_job (apart from it: one spawn for both)."""
    trainer = _trainer([f"checkpoint.dir={Path(root) / 'killed'}", "checkpoint.load=auto"])
    resumed = {"start": trainer.iteration, "losses": [r["loss"] for r in trainer.train()]}
    return {**async_job(root), "resumed": resumed}


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    with pytest.raises(RankFailure) as died:
        run_on_ranks(2, killed_job, str(root), timeout_s=within(240))
    killed = root / "killed"
    out = dict(died=str(died.value), on_disk=sorted(p.name for p in killed.iterdir()),
               found=find_checkpoint(killed)[0].name, latest=(killed / "latest").read_text(),
               root=root)
    out.update(run_on_ranks(2, resume_and_async_jobs, str(root), timeout_s=within(240))[0])
    return out


def test_auto_starts_fresh_then_resumes_from_the_newest_checkpoint(saves):
    assert saves["fresh start"] == 0 and saves["auto resumes at"] == 2


def test_background_saves_write_what_synchronous_saves_write(saves):
    assert saves["async losses"] == saves["sync losses"]
    for it in (2, 4, 6):
        name = iteration_dir_name(it)
        sync, background = (_saved_tensors(saves["root"] / k / name) for k in ("sync", "async"))
        assert sync.keys() == background.keys() and len(sync) == 4   # 2 shards, 2 RNG files
        for file, content in sync.items():
            assert _same(content, background[file]), f"{name}/{file}"
        meta = [json.loads((saves["root"] / k / name / "metadata.json").read_text())
                for k in ("sync", "async")]
        assert meta[0]["params"] == meta[1]["params"] and meta[0]["iteration"] == it


def test_checkpoints_carry_what_saves_cost_for_the_resumed_jobs_advice(saves):
    from ptdp.metrics.report import SaveTiming
    directory = saves["root"] / "sync" / iteration_dir_name(4)
    timing = json.loads((directory / "metadata.json").read_text())["timing"]
    assert timing["save_stall_s"] > 0 and timing["iteration_s"] > 0   # measured at iteration 2
    resumed = SaveTiming()
    resumed.resumed(directory)
    assert resumed.stall_s == timing["save_stall_s"]
    assert resumed.metadata()["iteration_s"] == timing["iteration_s"]


def test_a_rank_killed_during_a_background_write_leaves_the_previous_checkpoint(saves):
    assert "rank 1" in saves["died"]
    assert "iter_0000004.tmp" in saves["on_disk"] and "iter_0000004" not in saves["on_disk"]
    assert saves["latest"].strip() == saves["found"] == iteration_dir_name(2)


def test_the_killed_job_resumes_exactly_from_it(saves):
    assert saves["resumed"]["start"] == 2
    assert saves["resumed"]["losses"] == saves["sync losses"][2:]


# --------------------------------------------------------------------------------------------
# How often to save
# --------------------------------------------------------------------------------------------

def test_young_daly_interval():
    from ptdp.planner.formulas import checkpoint_interval_s
    assert checkpoint_interval_s(2.0, 86400.0) == pytest.approx(587.88, abs=0.01)   # sqrt(2*2*86400)
    with pytest.raises(ValueError):
        checkpoint_interval_s(1.0, 0.0)


@pytest.mark.parametrize("save_interval,advised", [(1000, True), (150, False), (0, True)])
def test_the_interval_is_suggested_once_when_far_from_the_optimum(save_interval, advised):
    from ptdp.config import CheckpointConfig
    from ptdp.metrics.report import SaveTiming
    ck = CheckpointConfig(dir="runs/x", save_interval=save_interval, mtbf_hours=24.0)
    timing = SaveTiming()
    for step in (30.0, 4.0, 4.0, 4.0):     # the first (start-up) is left out of the median
        timing.iteration(step)
    timing.saved(2.0)
    line = timing.advice(ck)
    assert (line is not None) == advised, line
    if advised:
        assert "about 147 iterations" in line and "consider checkpoint.save_interval=147" in line
    assert timing.advice(ck) is None                                   # once per job
    assert SaveTiming().advice(ck) is None                             # nothing measured yet
    quiet = SaveTiming()
    quiet.iteration(4.0), quiet.saved(2.0)
    assert quiet.advice(CheckpointConfig(dir="runs/x")) is None        # no mtbf_hours: silent
