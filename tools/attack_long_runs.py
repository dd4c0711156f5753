#!/usr/bin/env python3
"""Issue 35's attack on long runs, rerun: inject each fault of its numbered failures (1-8) into
real jobs on CPU ranks (torchrun and tools/pretrain_gpt.sh, 2 ranks, configs/gpt_tiny.yaml) and
check the outcome; feed bad inputs and check each ends in one line and exit 2. Prints a table
(faults survived / tried, bad inputs handled / tried) and writes JSON. Not part of the test
suite: it runs minutes of real jobs.

    python tools/attack_long_runs.py [--out attack.json] [--only NAME ...] [--list]

Faults count as survived when the run ends as the issue asks (exit 0 with every iteration
once and the uninterrupted run's losses where the run continues; otherwise the job ends with
ptdp's own line naming the cause). Not tried here: a multi-node restart (two launchers:
tests/test_multinode_restart.py) and a real full disk (no small file system to fill; the
injected one is tests/test_disk_full.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__:      # python -m tools.attack_long_runs
    from . import harness, jobs
else:                # python tools/attack_long_runs.py
    import harness
    import jobs

ROOT = jobs.ROOT
CONFIG = str(ROOT / "configs/gpt_tiny.yaml")
SCRIPT = str(jobs.SCRIPT)
ITERS = 20
RUN = ["parallel.pipeline=2", f"train.iters={ITERS}", "model.dropout=0.1", "train.timeout_s=60",
       "log.progress=false", "log.interval=1000"]
SAVING = RUN + ["checkpoint.save_interval=5", "checkpoint.load=auto"]


STARTED: list[subprocess.Popen] = []   # every job: stop_all ends it and what it started


def torchrun(overrides: list[str], cwd: Path, **extra) -> subprocess.Popen:
    STARTED.append(jobs.start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", "2", "-m", "ptdp", "train", CONFIG, *overrides],
                              cwd, **extra))
    return STARTED[-1]


def launch(overrides: list[str], cwd: Path, **extra) -> subprocess.Popen:
    STARTED.append(jobs.start(["bash", SCRIPT, CONFIG, *overrides], cwd, **extra))
    return STARTED[-1]


def stop_all() -> None:
    """End every job an attack left running (one that failed half-way), its workers too."""
    while STARTED:
        job = STARTED.pop()
        jobs.stop(job)
        job.communicate()


def finish(job: subprocess.Popen, timeout_s: float = 600) -> tuple[int, str]:
    try:
        out, _ = job.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        job.kill()
        out, _ = job.communicate()
        return -9, out + "\n[killed: timed out]"
    return job.returncode, out


def ptdp(*args: str, cwd: Path) -> tuple[int, list[str]]:
    done = subprocess.run([sys.executable, "-m", "ptdp", *args], cwd=cwd, env=jobs.env(),
                          capture_output=True, text=True, timeout=300)
    return done.returncode, [line for line in done.stderr.splitlines() if line.strip()]


def records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.exists() else []


def wait_for_iteration(metrics: Path, job: subprocess.Popen, n: int) -> None:
    """Until the job has logged n iterations; raises if it ends or stalls first (the attack
    then counts as failed, and stop_all ends the job)."""
    jobs.wait_for_iteration(metrics, job, n, timeout=300)


class Attack:
    def __init__(self, work: Path):
        self.work = work
        self._reference = None

    def reference(self) -> list[float]:
        """The uninterrupted run's losses, and its checkpoints (iterations 5..20) in ref/ck."""
        if self._reference is None:
            ref = self.work / "ref"
            shutil.rmtree(ref, ignore_errors=True)
            ref.mkdir()
            code, out = finish(torchrun(SAVING + [f"checkpoint.dir={ref / 'ck'}",
                                                  f"log.metrics_file={ref / 'm.jsonl'}"], ref))
            assert code == 0, out[-2000:]
            self._reference = [r["loss"] for r in records(ref / "m.jsonl")]
        return self._reference

    def _continued(self, folder: Path, code: int, out: str) -> tuple[bool, str]:
        got = records(folder / "m.jsonl")
        iters = [r["iter"] for r in got]
        same = [r["loss"] for r in got] == self.reference()
        ok = code == 0 and iters == list(range(1, ITERS + 1)) and same
        return ok, (f"exit {code}, iterations {'once each' if iters == list(range(1, ITERS + 1)) else iters}, "
                    f"losses {'identical' if same else 'differ'}" + ("" if ok else f": {out[-600:]}"))

    # 1 ----------------------------------------------------------------------------------------
    def fault_agent_killed(self):
        """kill -9 of the torchrun agent at iteration 8 under the launch script: the workers
        die with it and the restart loses nothing."""
        folder, marker = self.work / "agent", "agent-" + os.urandom(4).hex()
        folder.mkdir()
        job = launch(SAVING + [f"checkpoint.dir={folder / 'ck'}", f"log.metrics_file={folder / 'm.jsonl'}"],
                     folder, MAX_RESTARTS="1", PTDP_TEST_MARKER=marker)
        wait_for_iteration(folder / "m.jsonl", job, 8)
        agents = jobs.trainers(marker, agent=True)
        workers = jobs.trainers(marker)
        os.kill(agents[0], signal.SIGKILL)
        time.sleep(5)
        orphans = [p for p in workers if Path(f"/proc/{p}").exists()
                   and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1][:3]]
        ok, detail = self._continued(folder, *finish(job))
        return ok and not orphans, f"orphans {len(orphans)}; {detail}"

    # 2 ----------------------------------------------------------------------------------------
    def fault_killed_before_first_checkpoint(self):
        """A rank killed at iteration 3 of a run saving every 10: the restart starts afresh and
        the metrics file holds each iteration once."""
        folder, marker = self.work / "early", "early-" + os.urandom(4).hex()
        folder.mkdir()
        job = launch(RUN + ["checkpoint.save_interval=10", "checkpoint.load=auto",
                            f"checkpoint.dir={folder / 'ck'}", f"log.metrics_file={folder / 'm.jsonl'}"],
                     folder, MAX_RESTARTS="1", PTDP_TEST_MARKER=marker)
        wait_for_iteration(folder / "m.jsonl", job, 3)
        os.kill(jobs.pid_of_rank(1, marker), signal.SIGKILL)
        return self._continued(folder, *finish(job))

    # 3 ----------------------------------------------------------------------------------------
    def _damaged(self, name: str, damage) -> tuple[bool, str]:
        """The reference's checkpoints with iteration 20 damaged: `ptdp check` refuses that
        checkpoint in one line, and a resumed run skips it, loads 15 and ends as the reference."""
        self.reference()
        folder = self.work / name
        shutil.copytree(self.work / "ref" / "ck", folder / "ck")
        newest = folder / "ck" / "iter_0000020"
        damage(newest)
        code, lines = ptdp("check", CONFIG, *RUN, f"checkpoint.load={newest}", "--world-size", "2",
                           cwd=folder)
        refused = code == 2 and len(lines) == 1
        job = torchrun(RUN + ["checkpoint.load=auto", "checkpoint.save_interval=100",
                              f"checkpoint.dir={folder / 'ck'}", f"log.metrics_file={folder / 'm.jsonl'}"],
                       folder)
        code2, out = finish(job)
        losses = [r["loss"] for r in records(folder / "m.jsonl")]
        resumed = code2 == 0 and "skipping" in out and losses == self.reference()[15:20]
        return refused and resumed, (f"check exit {code} ({len(lines)} line(s)); resume exit {code2}, "
                                     f"{'skipped and matched' if resumed else out[-600:]}")

    def fault_flipped_bits(self):
        def flip(ck):
            shard = sorted(ck.glob("model_*.pt"))[0]
            data = bytearray(shard.read_bytes())
            for i in random.Random(0).sample(range(len(data) // 2, len(data)), 64):
                data[i] ^= 1
            shard.write_bytes(bytes(data))
        return self._damaged("flipped", flip)

    def fault_random_bytes(self):
        def scramble(ck):
            shard = sorted(ck.glob("model_*.pt"))[0]
            shard.write_bytes(os.urandom(shard.stat().st_size))
        return self._damaged("random", scramble)

    def fault_truncated_shard(self):
        def cut(ck):
            shard = sorted(ck.glob("model_*.pt"))[0]
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return self._damaged("truncated", cut)

    def fault_edited_metadata(self):
        def edit(ck):
            meta = json.loads((ck / "metadata.json").read_text())
            meta["iteration"] = 19
            (ck / "metadata.json").write_text(json.dumps(meta))
        return self._damaged("edited", edit)

    # 5 ----------------------------------------------------------------------------------------
    def fault_rank_frozen(self):
        """SIGSTOP of rank 1 in a run saving every iteration: ptdp's one line names it within
        train.timeout_s plus a save's time and torchrun's shutdown."""
        folder, marker = self.work / "frozen", "frozen-" + os.urandom(4).hex()
        folder.mkdir()
        job = torchrun(RUN + ["train.iters=100000", "train.timeout_s=6", "checkpoint.save_interval=1",
                              f"checkpoint.dir={folder / 'ck'}", f"log.metrics_file={folder / 'm.jsonl'}"],
                       folder, PTDP_TEST_MARKER=marker)
        wait_for_iteration(folder / "m.jsonl", job, 4)
        stopped = jobs.pid_of_rank(1, marker)
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        try:
            code, out = finish(job, timeout_s=200)
        finally:
            jobs.send([stopped], signal.SIGCONT, signal.SIGKILL)
        elapsed = time.monotonic() - start
        ours = [line for line in out.splitlines() if line.startswith("ptdp train: rank(s) stopped")]
        ok = code != 0 and len(ours) == 1 and "rank 1 " in ours[0] and "last in iteration" in ours[0]
        return ok, f"{elapsed:.0f} s, exit {code}: {ours[0][:160] if ours else out[-600:]}"

    # 6 ----------------------------------------------------------------------------------------
    def fault_stale_leftovers(self):
        """A dead job's `.tmp` save and start-up marker are swept before the job writes; the
        run then completes."""
        folder = self.work / "stale"
        (folder / "ck" / "iter_0000005.tmp").mkdir(parents=True)
        (folder / "ck" / ".ptdp-shared-deadbeef").write_text("")
        code, out = finish(torchrun(SAVING + ["train.iters=6", f"checkpoint.dir={folder / 'ck'}"], folder))
        left = [p.name for p in (folder / "ck").iterdir() if ".tmp" in p.name or "shared" in p.name]
        return code == 0 and not left, f"exit {code}, left {left}"

    # 7 ----------------------------------------------------------------------------------------
    def fault_bad_token_ids(self):
        """A Megatron pair (no sidecar) with ids beyond model.vocab_size under the launch script
        with MAX_RESTARTS=2: exit 2, one line, not restarted."""
        from ptdp.data.indexed import IndexedDatasetWriter, sidecar_path
        folder = self.work / "ids"
        folder.mkdir()
        prefix = folder / "corpus"
        with IndexedDatasetWriter(prefix, vocab_size=1000) as writer:
            for doc in range(50):
                writer.add_document([[300 + i if doc == 3 else (doc * 37 + i) % 200
                                      for i in range(64)]])
        sidecar_path(prefix).unlink()
        code, out = finish(launch(RUN + ["data.source=indexed", f"data.paths=[{prefix}]"], folder,
                                  MAX_RESTARTS="2"))
        lines = [line for line in out.splitlines() if "token ids" in line or "token id" in line]
        restarted = "restart" in out.lower() and "attempt" in out.lower()
        return code == 2 and len(lines) == 1 and not restarted, f"exit {code}: {lines}"

    # 8 (faults) -------------------------------------------------------------------------------
    def fault_killed_rank_named(self):
        """kill -9 of a rank under torchrun: ptdp's own one line names it."""
        folder, marker = self.work / "killed", "killed-" + os.urandom(4).hex()
        folder.mkdir()
        job = torchrun(RUN + ["train.iters=100000", f"log.metrics_file={folder / 'm.jsonl'}"], folder,
                       PTDP_TEST_MARKER=marker)
        wait_for_iteration(folder / "m.jsonl", job, 3)
        os.kill(jobs.pid_of_rank(1, marker), signal.SIGKILL)
        code, out = finish(job, timeout_s=200)
        ours = [line for line in out.splitlines() if line.startswith("ptdp train: ") and "rank" in line]
        return code != 0 and len(ours) == 1 and "rank 1" in ours[0], f"exit {code}: {ours[:2]}"

    def _beside(self, name: str, shared: list[str]) -> tuple[bool, str]:
        folder = self.work / name
        folder.mkdir()
        first = torchrun(RUN + ["train.iters=100000"] + shared, folder)
        metrics = next((Path(o.split("=", 1)[1]) for o in shared if o.startswith("log.metrics")), None)
        time.sleep(1)
        if metrics:
            wait_for_iteration(metrics, first, 2)
        else:
            time.sleep(20)
        code, out = finish(torchrun(RUN + shared, folder), 300)
        ours = [line for line in out.splitlines() if "in use by another job" in line]
        return code != 0 and len(ours) == 1, f"exit {code}: {ours[:1]}"

    def fault_two_torchruns_one_metrics_file(self):
        """A second direct torchrun on the metrics file of a running job without checkpoint.dir."""
        return self._beside("beside_metrics", [f"log.metrics_file={self.work / 'beside_metrics/m.jsonl'}"])

    def fault_two_torchruns_one_checkpoint_dir(self):
        """A second direct torchrun on the checkpoint.dir of a running job."""
        return self._beside("beside_ck", [f"checkpoint.dir={self.work / 'beside_ck/ck'}",
                                          "checkpoint.save_interval=1000",
                                          f"log.metrics_file={self.work / 'beside_ck/m.jsonl'}"])


def _preprocess(corpus: str) -> tuple[list[str], str]:
    """`ptdp preprocess` of `corpus` in the work folder: (arguments, the word its line holds)."""
    return (["preprocess", "--input", f"{{w}}/{corpus}", "--output-prefix", "{w}/o",
             "--tokenizer", "{w}/vocab.txt"], corpus)


BAD_INPUTS = {   # name: (ptdp arguments, a word the one line must hold); {w}: the work folder
    "from-megatron --out into a missing folder": (
        ["config", "from-megatron", "--out", "/nonexistent/dir/x.yaml", "--", "--num-layers", "2"],
        "/nonexistent"),
    "from-megatron --fp16 --bf16": (["config", "from-megatron", "--", "--fp16", "--bf16"], "fp16"),
    "preprocess: a malformed JSONL line": _preprocess("bad.jsonl"),
    "preprocess: a non-string text": _preprocess("number.jsonl"),
    "preprocess: non-UTF-8 input": _preprocess("latin1.jsonl"),
    "preprocess: a missing input": _preprocess("missing.jsonl"),
    "generate --device cuda without a GPU": (
        ["generate", "{w}/ref/ck", "--device", "cuda", "--prompt", "a", "--tokenizer",
         "{w}/vocab.txt"], "cuda"),
    "train: an unknown key": (["check", CONFIG, "train.iterz=3"], "train.iterz"),
    "train: a value of the wrong type": (["check", CONFIG, "train.iters=many"], "train.iters"),
    "train: a missing config file": (["check", "{w}/missing.yaml"], "missing.yaml"),
    "train: a missing checkpoint.load": (["check", CONFIG, "checkpoint.load={w}/nothing"],
                                         "checkpoint"),
    "checkpoint.finetune without checkpoint.load": (["check", CONFIG, "checkpoint.finetune=true"],
                                                    "checkpoint.finetune"),
    "train.grad_reduce_dtype=fp16": (["check", CONFIG, "train.grad_reduce_dtype=fp16"],
                                     "train.grad_reduce_dtype"),
    "checkpoint.keep_every=-3": (["check", CONFIG, "checkpoint.keep_every=-3"], "keep_every"),
}


def _bad_input_files(work: Path) -> None:
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(97, 123)]
    (work / "vocab.txt").write_text("\n".join(words) + "\n")
    (work / "bad.jsonl").write_text('{"text": "a b"}\n{"text": "unclosed\n')
    (work / "number.jsonl").write_text('{"text": 12345}\n')
    (work / "latin1.jsonl").write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))


def bad_input(work: Path, args: list[str], word: str) -> tuple[bool, str]:
    code, lines = ptdp(*[a.replace("{w}", str(work)) for a in args], cwd=work)
    ok = code == 2 and len(lines) == 1 and word in lines[0] and "Traceback" not in lines[0]
    return ok, f"exit {code}, {len(lines)} line(s): {lines[0][:150] if lines else ''}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attack_long_runs.json")
    parser.add_argument("--only", nargs="*", help="names (or parts of names) to run")
    parser.add_argument("--list", action="store_true", help="list the attacks and stop")
    args = parser.parse_args(argv)
    faults = [name for name in dir(Attack) if name.startswith("fault_")]
    chosen = lambda name: not args.only or any(part in name for part in args.only)  # noqa: E731
    if args.list:
        print("\n".join(faults + list(BAD_INPUTS)))
        return 0
    work = Path(tempfile.mkdtemp(prefix="ptdp-attack-"))
    attack, rows, results = Attack(work), [], {"faults": {}, "bad_inputs": {}}
    for name in filter(chosen, faults):
        start = time.monotonic()
        try:
            ok, detail = getattr(attack, name)()
        except Exception as err:   # an attack that could not be carried out counts as failed
            ok, detail = False, f"{type(err).__name__}: {err}"
        finally:
            stop_all()
        results["faults"][name[len("fault_"):]] = {"ok": ok, "detail": detail,
                                                   "seconds": round(time.monotonic() - start, 1)}
        rows.append(["fault", name[len("fault_"):], "yes" if ok else "NO", detail[:90]])
        print(" | ".join(rows[-1]), flush=True)
    _bad_input_files(work)
    if any(chosen(name) for name in BAD_INPUTS if "generate" in name):
        attack.reference()   # generate reads its checkpoint
    for name, (cmd, word) in BAD_INPUTS.items():
        if not chosen(name):
            continue
        ok, detail = bad_input(work, cmd, word)
        results["bad_inputs"][name] = {"ok": ok, "detail": detail}
        rows.append(["input", name, "yes" if ok else "NO", detail[:90]])
        print(" | ".join(rows[-1]), flush=True)
    survived = sum(r["ok"] for r in results["faults"].values())
    handled = sum(r["ok"] for r in results["bad_inputs"].values())
    results["summary"] = {"faults_survived": survived, "faults_tried": len(results["faults"]),
                          "bad_inputs_handled": handled, "bad_inputs_tried": len(results["bad_inputs"])}
    print(harness.table(["kind", "attack", "ok", "outcome"], rows, align="<"))
    print(f"faults survived {survived}/{len(results['faults'])}, bad inputs handled in one line "
          f"{handled}/{len(results['bad_inputs'])}")
    harness.write_json(args.out, results, tool="attack_long_runs", argv=argv)
    every = survived == len(results["faults"]) and handled == len(results["bad_inputs"])
    if every:   # a failed attack keeps its folder: the jobs' outputs are the evidence
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"attack_long_runs: the failed attacks' outputs are in {work}", file=sys.stderr)
    return 0 if every else 1


if __name__ == "__main__":
    sys.exit(main())
