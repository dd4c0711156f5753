"""Which boundary tensors each pipeline rank sends and receives, and when: NCCL-safe by design.

The schedule (``ptdp.pipeline.schedules``) lists a rank's compute actions. Between two of them
the rank posts one *exchange*: the sends and receives it issues together (one
``batch_isend_irecv``). This module derives those exchanges from the schedules of all ranks,
as pure data, so that they hold under NCCL's rules (tests/pipeline/nccl_rules.py), which are
stricter than gloo's:

1. **No tags.** A receive matches the next message from that peer, in issue order. So for
   every ordered pair of ranks, the sequence of messages the sender sends must equal the
   sequence the receiver receives, shapes included.
2. **In-order completion.** A rank's point-to-point operations run in issue order on one
   stream: an exchange completes only when every one of its operations has met its partner in
   the peer's *current* exchange, and the next exchange starts only after that. A receive
   posted too early blocks every later send (the rendezvous model; NCCL may buffer small
   messages, but correctness must not depend on it).

Placement rule. Every message is produced by one action and consumed by one action on another
rank (or the same rank: a chunk boundary inside one rank with p = 1 never crosses the wire,
since p = 1 has no pipeline). The schedules are played once on the timeline simulator
(``ptdp.pipeline.simulation.simulate_lists`` with ``exact_times``: forward 1, backward 2 time
units per whole stage); then

* the producer sends the message in the exchange right after the producing action, and
* the consumer receives it in its first exchange whose simulated time is no earlier than the
  message's production time (exchange ``k`` sits before action ``k``; its time is the
  action's simulated start; the last exchange sits after the last action).

Both sides thus place each message at the same logical moment, so an exchange's partners are
exchanges of the same moment, and within an exchange operations are ordered by (production
time, message), which both sides compute identically.

Several tensors per boundary. A stage may hand the next one more than one tensor (a hidden state
and a second output); ``tensors(boundary)`` says how many cross the boundary between stages
``boundary`` and ``boundary + 1``, and each is a message of its own (``Message.index``), with its
own shape, produced and consumed by the same actions: both sides derive the count and the
shapes from the same function, so the rules above hold for each, and the checker below sees
every one of them. A received tensor may wait in a buffer
until its action runs (posting early costs one boundary tensor of memory and lets the
transfer overlap compute). Naive placement (receive just before use) deadlocks under rule 2:
with GPipe and v = 2 rank 1 sends its first chunk-1 activation while rank 0, still pushing
forwards, has not yet posted that receive, and both stop.

No-flush schedules (2BW, PipeDream) run as one stream cut into iterations at their ``E``
actions (``ptdp.pipeline.schedules``). Between two iterations the trainer may validate (more
exchanges on the same group) or checkpoint (collectives), so no exchange may straddle an ``E``:
each message is received in the iteration it is sent in. A receive whose natural place lies in a
later iteration is posted in the sender's iteration instead (at the latest in the exchange just
before ``E``; the tensor then waits in a buffer across the boundary), and one whose natural place
lies in an earlier iteration is posted at the start of the sender's.

``check_plans`` replays every rank's exchanges under rules 1 and 2 and raises ``PlanError``
naming the pair or the stuck ranks. The replay also honours the rank actions that wait for other
ranks (``W`` and ``E`` for every rank's ``R``, ``T`` for rank 0's ``U``: collectives in the
trainer) and, by default, treats every ``E`` as a barrier of all ranks (the strongest thing the
trainer may do at an iteration boundary). The trainer runs it at start-up for its layout, and
``tests/pipeline/test_comm_plan.py`` runs it over every schedule, p <= 8, v <= 4, m in [p, 4p],
with and without scatter/gather. Nothing here imports torch.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, replace
from typing import Callable

from ptdp.config.stages import Placement
from ptdp.pipeline.actions import Action, BACKWARD, END, FORWARD, RANK_ACTIONS, dependencies
from ptdp.pipeline.simulation import exact_times, simulate_lists

ACTIVATION, GRADIENT = "act", "grad"


class PlanError(RuntimeError):
    """The exchanges would mismatch messages or deadlock under NCCL's rules."""


@dataclass(frozen=True, order=True)
class Message:
    """One boundary tensor: an activation (forward) or gradient (backward) of micro-batch ``mb``
    from global virtual stage ``src`` to the adjacent stage ``dst``; ``index``: which of the
    boundary's tensors (0 when it carries one)."""

    kind: str
    mb: int
    src: int
    dst: int
    index: int = 0

    @property
    def boundary(self) -> int:
        """The boundary it crosses: the one between stages ``boundary`` and ``boundary + 1``."""
        return min(self.src, self.dst)

    def __str__(self) -> str:
        tensor = f"#{self.index}" if self.index else ""
        return f"{self.kind}{tensor} mb{self.mb} s{self.src}->s{self.dst}"


@dataclass(frozen=True)
class Transfer:
    """One operation of an exchange: send ``message`` to, or receive it from, pipeline ``peer``."""

    send: bool
    peer: int
    message: Message
    shape: tuple

    def __str__(self) -> str:
        return f"{'send' if self.send else 'recv'} {self.message} {'to' if self.send else 'from'} {self.peer}"


@dataclass(frozen=True)
class Step:
    """Post ``exchange`` (all together), then run ``action`` (None after the last action)."""

    exchange: tuple[Transfer, ...]
    action: Action | None


def one_tensor(boundary: int) -> int:
    """Every boundary carries one tensor (the hidden state)."""
    return 1


def produced_message(action: Action, num_stages: int) -> Message | None:
    """The (first) tensor ``action`` hands to the adjacent stage, if any."""
    if action.kind == FORWARD and action.stage < num_stages - 1:
        return Message(ACTIVATION, action.mb, action.stage, action.stage + 1)
    if action.kind == BACKWARD and action.stage > 0:
        return Message(GRADIENT, action.mb, action.stage, action.stage - 1)
    return None


def needed_message(action: Action, num_stages: int) -> Message | None:
    """The (first) tensor ``action`` needs from the adjacent stage, if any."""
    if action.kind == FORWARD and action.stage > 0:
        return Message(ACTIVATION, action.mb, action.stage - 1, action.stage)
    if action.kind == BACKWARD and action.stage < num_stages - 1:
        return Message(GRADIENT, action.mb, action.stage + 1, action.stage)
    return None


def produced_messages(action: Action, num_stages: int,
                      tensors: Callable[[int], int] = one_tensor) -> tuple[Message, ...]:
    """Every tensor ``action`` hands to the adjacent stage (``tensors``: see module doc)."""
    return _boundary_messages(produced_message(action, num_stages), tensors)


def needed_messages(action: Action, num_stages: int,
                    tensors: Callable[[int], int] = one_tensor) -> tuple[Message, ...]:
    """Every tensor ``action`` needs from the adjacent stage."""
    return _boundary_messages(needed_message(action, num_stages), tensors)


def _boundary_messages(first: Message | None, tensors: Callable[[int], int]) -> tuple:
    if first is None:
        return ()
    count = tensors(first.boundary)
    return (first,) if count == 1 else tuple(replace(first, index=i) for i in range(count))


def plan_exchanges(schedule: list[list[Action]], p: int, v: int,
                   shape_of: Callable[[Message], tuple] = lambda message: (),
                   tensors: Callable[[int], int] = one_tensor,
                   placement: Placement = Placement.LOOPED) -> list[list[Step]]:
    """Every rank's steps: its actions with the exchange to post before each (see module doc).

    ``schedule`` is every rank's action list (``build_all``); ``shape_of`` gives each message's
    shape, recorded in its transfers so that both sides' shapes can be checked; ``tensors``
    how many tensors cross each stage boundary.
    """
    num_stages = p * v
    micro_batches = len({a.mb for row in schedule for a in row}) or 1
    timeline = simulate_lists(schedule, p, v, micro_batches, **exact_times(v),
                              placement=placement)
    rank_of = timeline.stages.rank_of   # the schedule's placement (spec.placement)
    produced_at = {}   # message -> (simulated time, iteration of the producing action)
    for row in timeline.ranks:
        for slot, segment in zip(row, _iterations(row)):
            for message in produced_messages(slot.action, num_stages, tensors):
                produced_at[message] = (slot.end, segment)
    plans = []
    for rank, row in enumerate(timeline.ranks):
        # exchange k sits before action k; the extra last one after the last action
        times = [slot.start for slot in row] + [row[-1].end if row else 0]
        bounds = _iteration_bounds(row)
        pending: list[list[tuple]] = [[] for _ in times]
        for k, slot in enumerate(row):
            for sent in produced_messages(slot.action, num_stages, tensors):
                if rank_of(sent.dst) != rank:
                    pending[k + 1].append((produced_at[sent][0], True, sent))
            for needed in needed_messages(slot.action, num_stages, tensors):
                if rank_of(needed.src) == rank:
                    continue
                at, segment = produced_at[needed]
                # times only grow, and times[k] >= at since action k needs the message
                natural = bisect_left(times, at, hi=k)
                first, last = bounds[segment]
                pending[min(max(natural, first), last)].append((at, False, needed))
        steps = []
        for k, ops in enumerate(pending):
            ops.sort(key=lambda op: (op[0], op[2], op[1]))
            exchange = tuple(Transfer(send, rank_of(msg.dst if send else msg.src), msg,
                                      tuple(shape_of(msg))) for _, send, msg in ops)
            steps.append(Step(exchange, row[k].action if k < len(row) else None))
        plans.append(steps)
    return plans


def _iterations(row) -> list[int]:
    """The iteration each slot of a rank's row belongs to (its E closes it)."""
    out, segment = [], 0
    for slot in row:
        out.append(segment)
        segment += slot.action.kind == END
    return out


def _iteration_bounds(row) -> dict:
    """iteration -> (first, last) exchange index of that iteration on this rank (no E: one)."""
    bounds, first = {}, 0
    ends = [k for k, slot in enumerate(row) if slot.action.kind == END]
    for segment, k in enumerate(ends):
        bounds[segment] = (first, k)
        first = k + 1
    bounds[len(ends)] = (first, len(row))
    return bounds


# ---------------------------------------------------------------------------- checking


def check_plans(plans: list[list[Step]], barriers: bool = True) -> None:
    """Raise PlanError unless the exchanges match in order and complete under NCCL's rules.

    ``barriers``: every rank waits at each ``E`` until all ranks reached theirs.
    """
    partner = _pair_transfers(plans)
    _replay_in_order(plans, partner, barriers)


def _pair_transfers(plans) -> dict:
    """(rank, step, index) of each operation -> (peer, step, index) of its partner (rule 1)."""
    sends: dict[tuple[int, int], list] = {}
    recvs: dict[tuple[int, int], list] = {}
    for rank, steps in enumerate(plans):
        for k, step in enumerate(steps):
            for i, op in enumerate(step.exchange):
                if op.send:
                    sends.setdefault((rank, op.peer), []).append((op, (rank, k, i)))
                else:
                    recvs.setdefault((op.peer, rank), []).append((op, (rank, k, i)))
    partner = {}
    for pair in set(sends) | set(recvs):
        out, into = sends.get(pair, []), recvs.get(pair, [])
        for j in range(max(len(out), len(into))):
            if j >= len(out) or j >= len(into):
                extra = out[j][0] if j < len(out) else into[j][0]
                raise PlanError(f"ranks {pair[0]}->{pair[1]}: {len(out)} sends but {len(into)} "
                                f"receives; unmatched: {extra}")
            (sent, a), (got, b) = out[j], into[j]
            if (sent.message, sent.shape) != (got.message, got.shape):
                raise PlanError(f"ranks {pair[0]}->{pair[1]}, message {j}: rank {pair[0]} sends "
                                f"{sent.message} {list(sent.shape)} but rank {pair[1]} receives "
                                f"{got.message} {list(got.shape)}")
            partner[a], partner[b] = b, a
    return partner


def _replay_in_order(plans, partner, barriers: bool) -> None:
    """Rule 2: each rank at one exchange at a time; an operation completes when its partner's
    rank stands at the partner's exchange; a rank moves on when its exchange is complete and
    its action's waits on other ranks (``_Gates``) are over."""
    at = [0] * len(plans)              # the exchange each rank stands at
    done: set = set()
    gates = _Gates(plans, barriers)
    progressed = True
    while progressed:
        progressed = False
        for rank, steps in enumerate(plans):
            while at[rank] < len(steps):
                k = at[rank]
                for i in range(len(steps[k].exchange)):
                    peer, pk, pi = partner[(rank, k, i)]
                    if at[peer] == pk and (rank, k, i) not in done:
                        done.update({(rank, k, i), (peer, pk, pi)})
                if not _exchanged(plans, done, rank, k) or not gates.open(rank, k, at, done):
                    break
                at[rank] += 1
                progressed = True
    stuck = [r for r, steps in enumerate(plans) if at[r] < len(steps)]
    if stuck:
        lines = []
        for r in stuck:
            step = plans[r][at[r]]
            waiting = [str(op) for i, op in enumerate(step.exchange) if (r, at[r], i) not in done]
            what = "; ".join(waiting) or f"other ranks before {step.action} (gate)"
            lines.append(f"rank {r} at exchange {at[r]} before {step.action}: {what}")
        raise PlanError("point-to-point exchanges deadlock under in-order completion:\n  "
                        + "\n  ".join(lines))


def _exchanged(plans, done, rank: int, k: int) -> bool:
    return all((rank, k, i) in done for i in range(len(plans[rank][k].exchange)))


class _Gates:
    """Rank actions that wait for other ranks: the action's ``dependencies()`` on other ranks
    must have run, and with ``barriers`` an ``E`` waits until every rank stands at its own."""

    def __init__(self, plans, barriers: bool):
        self.plans, self.barriers = plans, barriers
        self.position = {}   # (rank, action) -> its step index
        for rank, steps in enumerate(plans):
            for k, step in enumerate(steps):
                if step.action is not None and step.action.kind in RANK_ACTIONS:
                    self.position[(rank, step.action)] = k
        self.p = len(plans)

    def open(self, rank: int, k: int, at: list, done: set) -> bool:
        action = self.plans[rank][k].action
        if action is None or action.kind not in RANK_ACTIONS:
            return True
        for dep in dependencies(action, self.p, 1):
            dep_rank = dep.stage   # a rank action's dependencies are rank actions (their rank)
            if dep_rank != rank and at[dep_rank] <= self.position[(dep_rank, dep)]:
                return False
        if self.barriers and action.kind == END:
            for other in range(self.p):
                there = self.position[(other, Action(END, action.mb, other))]
                if at[other] < there or (at[other] == there
                                         and not _exchanged(self.plans, done, other, there)):
                    return False
        return True

