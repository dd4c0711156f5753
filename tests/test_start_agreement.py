"""Every rank's start-up verdict made one (ptdp/runtime/agreement.py, ptdp/commands/train.py).

* Over one store, ranks as threads: every rank gets the same verdict, named with the rank that
  found it when not all did; a rank that never arrives is named once the timeout passes.
* Two ranks launched directly, one of which finds a problem the other does not (a checkpoint
  to load that only its node lacks): both exit 2 at once and rank 0 prints the problem, naming
  rank 1. Rank 1 used to exit alone without a word and leave rank 0 waiting for it until the
  backend's timeout (600 s).
* A folder the rank cannot create is one line, not a traceback.
"""

from __future__ import annotations

import threading

import pytest

from ptdp.runtime.agreement import MissingRanks, agree
from ptdp.runtime.local_ranks import free_port
from tools.jobs import ROOT, train_direct


def _on_threads(world: int, problems: dict, timeout_s: float = 30.0, absent=()) -> dict:
    import torch.distributed as dist
    store, out = dist.HashStore(), {}

    def rank(r: int) -> None:
        try:
            out[r] = agree(store, r, world, problems.get(r, []), timeout_s)
        except MissingRanks as err:
            out[r] = err.line

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world) if r not in absent]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 30)
    return out


@pytest.mark.parametrize("problems, expected", [
    ({}, []),
    ({r: ["held"] for r in range(3)}, ["held"]),                        # every rank saw it
    ({2: ["no data", "no tokenizer"]},
     ["rank 2 (1 of 3 ranks found it): no data", "rank 2 (1 of 3 ranks found it): no tokenizer"]),
])
def test_the_ranks_verdicts_are_made_one(problems, expected):
    assert _on_threads(3, problems) == {r: expected for r in range(3)}


def test_a_rank_that_never_arrives_is_named_after_the_timeout():
    out = _on_threads(4, {}, timeout_s=1.0, absent=(2,))
    line = ("1 of 4 ranks never reached start-up within 1 s (rank 2): they ended or hang before "
            "it; see their output")
    assert out == {0: line, 1: None, 3: None}   # one line, from rank 0


class _GoneStore:
    """A store whose host has ended (rank 0 under srun): every call fails."""

    def add(self, key, value):
        return 1

    def set(self, key, value):
        pass

    def wait(self, keys, timeout=None):
        raise RuntimeError("Connection reset by peer")

    check = wait


def test_a_store_that_went_away_is_one_line_from_rank_1():
    lines = {}
    for rank in (1, 2):
        with pytest.raises(MissingRanks) as err:
            agree(_GoneStore(), rank, 3, [], 5.0)
        lines[rank] = err.value.line
    assert lines[2] is None and lines[1].startswith("the job's rendezvous store went away")


def test_a_problem_found_by_one_rank_only_ends_every_rank_with_one_line(tmp_path):
    missing = tmp_path / "only-on-node-0"
    ended = train_direct([["train.iters=1"], ["train.iters=1", f"checkpoint.load={missing}"]],
                         free_port())   # (no hang: seconds)
    said = [err for _, err in ended]
    assert [code for code, _ in ended] == [2, 2], said
    lines = [[line for line in err.splitlines() if line.startswith("ptdp train")] for err in said]
    assert len(lines[0]) == 1 and lines[1] == [], said
    assert lines[0][0].startswith("ptdp train: rank 1 (1 of 2 ranks found it): checkpoint.load")
    assert str(missing) in lines[0][0]
    assert "Traceback" not in said[0] + said[1]


def test_a_folder_the_rank_cannot_create_is_one_line(tmp_path):
    from ptdp.checks import Findings
    from ptdp.commands.train import _own_problems
    from ptdp.config.loading import parse_config
    (tmp_path / "file").write_text("not a folder")
    cfg = parse_config(str(ROOT / "configs/gpt_tiny.yaml"),
                       [f"checkpoint.dir={tmp_path / 'file' / 'checkpoints'}"])
    problems = _own_problems(Findings(cfg=cfg))
    assert len(problems) == 1 and problems[0].startswith("cannot hold the job's outputs: ")
    assert "Not a directory" in problems[0] and "file/checkpoints" in problems[0], problems
