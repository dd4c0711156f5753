"""Every rank's start-up verdict made one, before any process group exists.

`ptdp train` checks the job on every rank (ptdp/checks.py) and then holds its outputs
(ptdp/runtime/joblock.py). Ranks can find different things: a dataset, a tokenizer or a package
present on one node only, a folder the nodes see differently, a job lock taken between two
ranks' looks. A rank that left alone would leave the others waiting for it in the process
group's rendezvous until the backend's timeout, without a word: only rank 0 prints. So the ranks
pool their verdicts through the job's rendezvous store (ptdp/runtime/startup.py `job_store`):
if any rank found a problem, every rank exits and rank 0 prints it, naming the rank that found it
when not every rank did. A rank that never arrives (killed, or stuck before start-up) is named
once, after `timeout_s`, instead of a store timeout's traceback on every rank.

Each rank adds to two counters, sets one key and waits twice, whatever the number of ranks.
"""

from __future__ import annotations

from datetime import timedelta

PREFIX = "ptdp-start/"      # the keys' prefix in the job's store
READ_BACK_S = 30.0          # how long rank 0 keeps its store up for the others to read the verdict


class MissingRanks(RuntimeError):
    """Some ranks never reached the agreement. `line` names them on the lowest rank that did
    arrive (None on the others: one line for the job, not one per rank)."""

    def __init__(self, line: str | None):
        super().__init__(line or "ranks missing at start-up")
        self.line = line


def _key(name: str) -> str:
    return PREFIX + name


def agree(store, rank: int, world: int, problems: list[str], timeout_s: float) -> list[str]:
    """The lines to stop the job with: the problems of the first rank that found any
    (prefixed with its rank when not every rank found problems), or [] when no rank did.
    MissingRanks when some rank has not arrived within `timeout_s`."""
    if problems and store.add(_key("refused"), 1) == 1:
        store.set(_key("lines"), "\n".join([str(rank), *problems]))   # (before arriving)
    store.set(_key(f"here/{rank}"), "1")
    if store.add(_key("arrived"), 1) == world:
        store.set(_key("done"), "1")
    try:
        store.wait([_key("done")], timedelta(seconds=timeout_s))
    except RuntimeError as err:   # the store's timeout, or a store that went away
        raise _missing(store, rank, world, timeout_s) from err
    verdict = _verdict(store, world)
    _keep_store_until_read(store, rank, world)
    return verdict


def _verdict(store, world: int) -> list[str]:
    count = store.add(_key("refused"), 0)
    if count == 0:
        return []
    first, *lines = store.get(_key("lines")).decode().split("\n")
    if count == world:
        return lines
    return [f"rank {first} ({count} of {world} ranks found it): {line}" for line in lines]


def _keep_store_until_read(store, rank: int, world: int) -> None:
    """Without torchrun (srun, one task per rank) rank 0 hosts the store: leaving at once, it
    would take the verdict away from ranks still reading it."""
    if store.add(_key("read"), 1) == world:
        store.set(_key("all read"), "1")
    if rank == 0:
        try:
            store.wait([_key("all read")], timedelta(seconds=READ_BACK_S))
        except RuntimeError:
            pass   # a rank died after the verdict: nothing left to wait for


def _missing(store, rank: int, world: int, timeout_s: float) -> MissingRanks:
    """The ranks that never arrived, named by the lowest rank that did (a rank below this one
    that arrived names them: a check or two per rank, not world² of them on the store)."""
    def here(r: int) -> bool:
        return store.check([_key(f"here/{r}")])

    try:
        if any(here(r) for r in range(rank)):
            return MissingRanks(None)
        missing = [*range(rank), *(r for r in range(rank + 1, world) if not here(r))]
    except RuntimeError:   # the store itself is gone: its host (rank 0 under srun) ended
        line = ("the job's rendezvous store went away before every rank reached start-up "
                "(rank 0 ended?); see its output")
        return MissingRanks(line if rank == 1 else None)
    shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
    return MissingRanks(f"{len(missing)} of {world} ranks never reached start-up within "
                        f"{timeout_s:g} s (rank{'s' if len(missing) > 1 else ''} {shown}): "
                        f"they ended or hang before it; see their output")
