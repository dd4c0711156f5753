"""Commands a test module starts at once and its tests read when they get to them.

A command is mostly one core's work (an interpreter importing torch, a `ptdp check`): started
together, or while the module's in-process tests run, they keep both cores busy where one at a
time leaves one idle. Each is started in a session of its own, so that one that overruns is
ended with everything it started; its test waits for it with its own bound (`within`).
"""

from __future__ import annotations

import os
import signal
import subprocess


def start(args: list, **kwargs) -> subprocess.Popen:
    """`args` started now, its output captured as text (Popen's keywords: cwd, env)."""
    return subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)


def finish(proc: subprocess.Popen, timeout_s: float) -> subprocess.CompletedProcess:
    """What `proc` printed and its exit code, once it has ended (a second call gives the same);
    if it has not within `timeout_s`, it is ended with what it started and TimeoutExpired
    raised."""
    if not hasattr(proc, "finished"):
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        finally:
            end([proc])
        proc.finished = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return proc.finished


def end(procs) -> None:
    """End each of `procs` still running, and everything it started."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()
