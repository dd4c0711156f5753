"""The vocabulary of pipeline schedules: actions, where each virtual stage runs, and which
actions must finish before another can start. Pure Python, no torch.

Stages. The layer stack is cut into ``p * v`` *virtual stages*; which layers each holds is
``layer_ranges`` (ptdp/config/stages.py: ``L/(p*v)`` each, or ``parallel.stage_layers``); the
actions never depend on it. Which rank runs a stage, as which of
its chunks, is the schedule's placement (``ScheduleSpec.stage_map``, ptdp/config/stages.py:
Megatron's round-robin for every schedule today, with p=4, v=2 rank 0 holding stages 0 and 4).
With ``v == 1`` a stage is simply a rank.

Dependencies (``dependencies()``). ``F(mb, s)`` needs ``F(mb, s-1)``; ``B(mb, s)`` needs
``F(mb, s)`` (same rank, for the stashed activations) and ``B(mb, s+1)``; the last stage's
backward needs only its own forward. Sends are asynchronous, so a rank only ever waits on the
*inputs* of its next action; a schedule is valid when every rank can run its list strictly in
order under these rules (``ptdp.pipeline.simulation`` checks this and names the stuck rank
otherwise). Rank actions (the no-flush schedules' R, W, U, T, E: ptdp/pipeline/no_flush.py) tie
ranks together too: W and E wait for every rank's R, T for rank 0's U.
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config.stages import StageMap

FORWARD = "F"
BACKWARD = "B"    # the whole backward, or with zb-h1 only the input gradient
WEIGHT_GRAD = "Wg"  # zb-h1: the weight gradients of a micro-batch's B on the same stage
REDUCE = "R"      # rank actions of the no-flush schedules (ptdp/pipeline/no_flush.py)
WEIGHTS = "W"
UPDATE = "U"
TIED = "T"
END = "E"
COMPUTE = (FORWARD, BACKWARD, WEIGHT_GRAD)
RANK_ACTIONS = (REDUCE, WEIGHTS, UPDATE, TIED, END)


@dataclass(frozen=True)
class Action:
    """One unit of work on one rank: ``kind`` for micro-batch ``mb`` on global virtual ``stage``."""

    kind: str  # "F" (forward), "B" (backward), "Wg" (weight gradients) or a rank action
    mb: int  # micro-batch index (0..m-1, or across the window for the no-flush schedules)
    stage: int  # GLOBAL virtual stage index 0..p*v-1 (a rank action: the rank)

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}@s{self.stage}"


def action_rank(action: Action, stages: StageMap) -> int:
    """The pipeline rank that runs ``action`` (its stage in range): a rank action names its
    rank, the others run where their stage is placed."""
    return action.stage if action.kind in RANK_ACTIONS else stages.ranks[action.stage]


def split_units(actions) -> set[tuple[int, int]]:
    """The (mb, stage) whose backward is split: a ``Wg`` action follows their ``B``."""
    return {(a.mb, a.stage) for a in actions if a.kind == WEIGHT_GRAD}


def dependencies(action: Action, p: int, v: int) -> list[Action]:
    """Actions (on any rank) that must have finished before ``action`` can start."""
    if action.kind == FORWARD:
        return [] if action.stage == 0 else [Action(FORWARD, action.mb, action.stage - 1)]
    if action.kind == BACKWARD:
        deps = [Action(FORWARD, action.mb, action.stage)]  # its own stashed activations
        if action.stage < p * v - 1:  # the last stage starts backward from the loss
            deps.append(Action(BACKWARD, action.mb, action.stage + 1))
        return deps
    if action.kind == WEIGHT_GRAD:  # the B of the same micro-batch and stage left it pending
        return [Action(BACKWARD, action.mb, action.stage)]
    if action.kind in (WEIGHTS, END):  # the iteration's reduction spans every rank
        return [Action(REDUCE, action.mb, rank) for rank in range(p)]
    if action.kind == TIED:  # the other copy's gradient comes from rank 0's update
        return [Action(UPDATE, action.mb, 0)]
    if action.kind in (REDUCE, UPDATE):
        return []
    raise ValueError(f"unknown action kind {action.kind!r} in {action}")
