"""Exhaustive search over layouts (p, t, d, v, b, schedule, recompute, scatter/gather), and
context parallelism c when pinned (`--fix c=2`, or the YAML's parallel.context): c = 1 otherwise.
For a mixture of experts also expert parallelism e: every divisor of d*c that divides the
number of experts E (`--fix e=` pins it); dense models have e = 1.

Like Algorithm 1 but over every dimension at once: enumerate every valid
combination, predict it with the cost model, drop those that do not fit in memory, rank the
rest by step time. Choices that can never work are pruned as early as possible and counted
by reason, so the CLI can say why the others lost. Micro-batch sizes are tried in increasing
order and the loop stops at the first one that does not fit (memory grows with b).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ptdp.config.catalogue import Chunks, DEFAULT, Planner, names_where, schedule_spec
from ptdp.config.models import family_names
from ptdp.hardware import HardwareProfile
from ptdp.planner.cost_model import Layout, Prediction, RECOMPUTE, SCHEDULES, Workload, predict
from ptdp.planner.errors import PlanError

FIX_KEYS = {"p": "pipeline", "pipeline": "pipeline", "t": "tensor", "tensor": "tensor",
            "d": "data", "data": "data", "v": "chunks", "chunks": "chunks",
            "c": "context", "context": "context",
            "b": "micro_batch", "micro_batch": "micro_batch", "micro_batch_size": "micro_batch",
            "schedule": "schedule", "recompute": "recompute", "sg": "scatter_gather",
            "scatter_gather": "scatter_gather", "distopt": "distributed_optimizer",
            "distributed_optimizer": "distributed_optimizer", "sp": "sequence_parallel",
            "sequence_parallel": "sequence_parallel", "e": "expert", "expert": "expert"}
INT_KEYS = ("pipeline", "tensor", "data", "chunks", "micro_batch", "context", "expert")
# Searched unless the user opts in to more (ptdp/config/catalogue.py: 2BW changes the update rule).
STRICT_SCHEDULES = names_where(lambda spec: spec.planner is Planner.SEARCHED)

# Rejection categories, in the order the CLI lists them.
INDIVISIBLE = "indivisible"
SCHEDULE_RULE = "schedule rule"
OUT_OF_MEMORY = "out of memory"


@dataclass
class Rejections:
    counts: dict = field(default_factory=dict)
    examples: dict = field(default_factory=dict)

    def add(self, category: str, message: str, count: int = 1) -> None:
        self.counts[category] = self.counts.get(category, 0) + count
        self.examples.setdefault(category, message)

    def as_dict(self) -> dict:
        return {c: {"count": n, "example": self.examples[c]} for c, n in self.counts.items()}


@dataclass
class SearchResult:
    ranked: list[Prediction]
    rejected: Rejections
    evaluated: int
    seconds: float
    experts: dict = field(default_factory=dict)   # e -> layouts evaluated with it (MoE)

    @property
    def best(self) -> Prediction:
        return self.ranked[0]


def parse_fix(text: str | None) -> dict:
    """'p=8,t=8,schedule=interleaved' -> {'pipeline': 8, 'tensor': 8, 'schedule': ...}."""
    fixed: dict = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        if "=" not in item:
            raise PlanError(f"--fix '{item}': expected key=value, e.g. p=8,t=8")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in FIX_KEYS:
            raise PlanError(f"--fix: unknown key '{key}'; use p, t, c, d, v, b, schedule, "
                            f"recompute, sg, sp, distopt or e")
        name = FIX_KEYS[key]
        if name in INT_KEYS:
            if not value.isdigit() or int(value) < 1:
                raise PlanError(f"--fix {key}={value}: expected a positive integer")
            fixed[name] = int(value)
        elif name == "schedule":
            if value not in SCHEDULES:
                raise PlanError(f"--fix schedule={value}: not one of {', '.join(SCHEDULES)}")
            fixed[name] = value
        elif name == "recompute":
            if value not in RECOMPUTE:
                raise PlanError(f"--fix recompute={value}: not one of {', '.join(RECOMPUTE)}")
            fixed[name] = value
        else:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise PlanError(f"--fix {key}={value}: expected true or false")
            fixed[name] = value.lower() in ("true", "1", "yes")
    return fixed


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _choices(name: str, options, fixed: dict) -> list:
    return [fixed[name]] if name in fixed else list(options)


def check_fix_against_gpus(fixed: dict, gpus: int) -> None:
    """Fail fast, naming the key, when a fixed value cannot divide the GPU count."""
    product = 1
    for key, flag in (("pipeline", "p"), ("tensor", "t"), ("context", "c"), ("data", "d")):
        if key in fixed:
            if gpus % fixed[key]:
                raise PlanError(f"--fix {flag}={fixed[key]}: {fixed[key]} does not divide the "
                                f"{gpus} GPUs")
            product *= fixed[key]
    if gpus % product:
        raise PlanError(f"--fix: the fixed sizes multiply to {product}, which does not divide "
                        f"the {gpus} GPUs")
    if all(k in fixed for k in ("pipeline", "tensor", "data")) and product != gpus:
        raise PlanError(f"--fix: p*t*{'c*' if 'context' in fixed else ''}d = {product} but "
                        f"there are {gpus} GPUs")


def _schedule_options(work: Workload, p: int, m: int, fixed: dict, rej: Rejections, where: str,
                      schedules: tuple):
    """(schedule, v) pairs valid for this pipeline depth and micro-batch count."""
    layers = work.shape.layers
    out = []
    for name in _choices("schedule", schedules, fixed):
        spec = schedule_spec(name)
        if spec.chunks is Chunks.REQUIRED:
            if p == 1:
                continue
            if m % p:
                rej.add(SCHEDULE_RULE, f"{where}: {name} needs m={m} micro-batches to be "
                                       f"a multiple of p={p}")
                continue
            vs = _choices("chunks", [v for v in divisors(layers // p) if v > 1], fixed)
            for v in vs:
                if v > 1 and layers % (p * v) == 0:
                    out.append((name, v))
                else:
                    rej.add(INDIVISIBLE, f"{where}: {layers} layers not divisible by p*v = {p}*{v}")
            continue
        if fixed.get("chunks", 1) != 1:
            continue  # v > 1 only exists with the interleaved schedule
        if not spec.flushing:   # 2BW: searched with v = 1 only
            if p == 1:
                continue
            if work.shape.mtp_layers:   # the trainer refuses it (ptdp/config/mtp.py)
                rej.add(SCHEDULE_RULE, f"{where}: {name} does not add the MTP depths' "
                                       f"losses (side outputs) to the objective")
                continue
            least = spec.min_micro_batches(p, 1)
            if m < least:
                rej.add(SCHEDULE_RULE, f"{where}: {name} needs m={m} >= p={p} micro-batches")
                continue
        if name != DEFAULT.name and spec.flushing and p == 1 and "schedule" not in fixed:
            continue  # identical to 1f1b without a pipeline
        out.append((name, 1))
    return out


def _shape_reason(work: Workload, t: int, p: int) -> str | None:
    s = work.shape
    for what, size in (("num_heads", s.heads), ("num_kv_heads", s.kv_heads),
                       ("hidden_size", s.hidden), ("ffn_hidden_size", s.ffn)):
        if size % t:
            return f"t={t}: model.{what} ({size}) not divisible by t"
    if s.layers % p:
        return f"p={p}: model.num_layers ({s.layers}) not divisible by p"
    return None


def _context_reason(work: Workload, c: int) -> str | None:
    """Context parallelism (c > 1) splits a causal decoder's sequence into 2c chunks (with
    latent attention, value heads no larger than the query/key heads: ptdp/config/latent.py)."""
    s = work.shape
    if c == 1:
        return None
    if not s.family.causal:
        causal = family_names(lambda f: f.causal)
        return f"c={c}: context parallelism supports model.arch={causal} only"
    if s.dropout:
        return f"c={c}: context parallelism needs model.dropout=0"
    if s.latent and s.v_head_dim > s.qk_head_dim:
        return f"c={c}: the context ring pads value heads up to the query/key heads' size"
    if s.seq % (2 * c):
        return f"c={c}: model.seq_length ({s.seq}) not divisible by 2c = {2 * c}"
    return None


def search(hw: HardwareProfile, work: Workload, gpus: int, fixed: dict | None = None,
           attention: str | None = None, schedules: tuple = STRICT_SCHEDULES,
           distributed_optimizer: bool = False) -> SearchResult:
    """Every valid layout for `gpus` GPUs, feasible ones ranked by predicted step time.

    `schedules` defaults to the flushing ones, which keep the optimizer's semantics exact;
    2BW (W(t+1) = W(t) - lr * grad f(W(t-1))) changes the update rule, so callers
    opt in (the CLI's --allow-2bw, or --fix schedule=2bw).
    `distributed_optimizer`: also try each layout with d > 1 with the optimizer state sharded
    over d (the CLI's --allow-distributed-optimizer, or --fix distopt=true). Off by default:
    the source's plans (and the tests that reproduce them) have every replica hold it all.
    """
    fixed = dict(fixed or {})
    if not distributed_optimizer and "distributed_optimizer" not in fixed:
        fixed["distributed_optimizer"] = False
    check_fix_against_gpus(fixed, gpus)
    start = time.perf_counter()
    rej, ranked, evaluated, experts = Rejections(), [], 0, {}
    B = work.global_batch
    c = fixed.get("context", 1)
    for t in _choices("tensor", divisors(gpus), fixed):
        for p in _choices("pipeline", divisors(gpus // t) if gpus % t == 0 else [], fixed):
            if gpus % (t * p * c):
                continue
            d = gpus // (t * p * c)
            if "data" in fixed and fixed["data"] != d:
                continue
            reason = _shape_reason(work, t, p) or _context_reason(work, c)
            if reason is None and B % d:
                reason = f"d={d}: global batch {B} not divisible by d"
            if reason:
                rej.add(INDIVISIBLE, reason)
                continue
            for b in _choices("micro_batch", divisors(B // d), fixed):
                if (B // d) % b:
                    rej.add(INDIVISIBLE, f"b={b}: B/d = {B // d} not divisible by b")
                    continue
                evaluated += _try_micro_batch(hw, work, t, p, d, b, fixed, attention, rej, ranked,
                                              schedules, experts)
    ranked.sort(key=lambda pr: (pr.step_time_s, pr.memory_gb_per_gpu, pr.layout.chunks,
                                pr.layout.scatter_gather, not pr.layout.sequence_parallel))
    return SearchResult(ranked, rej, evaluated, time.perf_counter() - start, experts)


def expert_options(experts: int, replicas: int, fixed: dict, rej: Rejections,
                   where: str) -> list[int]:
    """e folds out of the d*c replicas and splits the E experts evenly: divisors of d*c that
    divide E (1 for a dense model)."""
    if not experts:
        if fixed.get("expert", 1) > 1:
            rej.add(SCHEDULE_RULE, f"e={fixed['expert']}: expert parallelism needs "
                                   f"model.num_experts > 0")
            return []
        return [1]
    options = [e for e in _choices("expert", divisors(replicas), fixed)
               if replicas % e == 0 and experts % e == 0]
    if not options:
        rej.add(INDIVISIBLE, f"{where}: e={fixed['expert']} must divide d*c = {replicas} and "
                             f"the {experts} experts")
    return options


def _modules(recompute: str, fixed: dict) -> tuple | None:
    """recompute=selective's modules: `fixed["recompute_modules"]` (the API's; e.g. the
    paper's ("core_attn",)), else None, the trainer's default (ptdp/config/recompute.py)."""
    return fixed.get("recompute_modules") if recompute == "selective" else None


def _try_micro_batch(hw, work, t, p, d, b, fixed, attention, rej, ranked, schedules,
                     experts: dict) -> int:
    m = work.global_batch // (d * b)
    c = fixed.get("context", 1)
    where = f"p={p} t={t}{f' c={c}' if c > 1 else ''} d={d} b={b}"
    evaluated = 0
    for schedule, v in _schedule_options(work, p, m, fixed, rej, where, schedules):
        sg_options = [False, True] if p > 1 and t > 1 else [False]
        for recompute in _choices("recompute", RECOMPUTE, fixed):
            for sg in _choices("scatter_gather", sg_options, fixed):
                if sg and not (p > 1 and t > 1):
                    rej.add(SCHEDULE_RULE, f"{where}: scatter/gather needs p > 1 and t > 1")
                    continue
                for sp in _sequence_parallel_options(t, sg, schedule, fixed, rej, where):
                    if sp and c > 1 and work.shape.seq % (2 * c * t):
                        rej.add(INDIVISIBLE, f"{where}: sequence parallelism with c={c} needs "
                                             f"s divisible by 2ct = {2 * c * t}")
                        continue
                    for zero in _distributed_optimizer_options(d * c, schedule, fixed, rej,
                                                               where):
                        for e in expert_options(work.shape.experts, d * c, fixed, rej, where):
                            lay = Layout(p, t, d, v, b, schedule, recompute, sg,
                                         distributed_optimizer=zero, sequence_parallel=sp,
                                         context=c, expert=e,
                                         recompute_modules=_modules(recompute, fixed))
                            evaluated += 1
                            if work.shape.experts:
                                experts[e] = experts.get(e, 0) + 1
                            _rank_or_reject(hw, work, lay, attention, rej, ranked)
    return evaluated


def _distributed_optimizer_options(d: int, schedule: str, fixed: dict, rej: Rejections,
                                   where: str) -> list[bool]:
    """The distributed optimizer shards over d > 1 data ranks of a flushing schedule (the
    trainer refuses it with 2bw)."""
    if d > 1 and schedule_spec(schedule).allows_distributed_optimizer:
        return _choices("distributed_optimizer", [False, True], fixed)
    if fixed.get("distributed_optimizer"):
        rej.add(SCHEDULE_RULE, f"{where} {schedule}: the distributed optimizer needs d > 1 and "
                               f"a flushing schedule")
        return []
    return [False]


def _sequence_parallel_options(t: int, sg: bool, schedule: str, fixed: dict, rej: Rejections,
                               where: str) -> list[bool]:
    """Sequence parallelism needs t > 1, implies scatter/gather and runs flushing schedules."""
    allowed = t > 1 and not sg and schedule_spec(schedule).allows_sequence_parallel
    options = _choices("sequence_parallel", [False, True] if allowed else [False], fixed)
    if True in options and not allowed:
        rej.add(SCHEDULE_RULE, f"{where}: sequence parallelism needs t > 1, no scatter/gather "
                               f"and a flushing schedule")
        return [o for o in options if not o]
    return options


def _rank_or_reject(hw, work, lay: Layout, attention, rej: Rejections, ranked: list) -> None:
    pred = predict(hw, work, lay, attention=attention)
    if pred.fits:
        ranked.append(pred)
    else:
        usable = hw.usable_memory_bytes / 2**30
        rej.add(OUT_OF_MEMORY, f"{lay.describe()} needs {pred.memory_gb_per_gpu:.1f} GB "
                               f"> {usable:.1f} GB usable of {hw.memory_gb:g}")


def why_slower(pred: Prediction, best: Prediction) -> str:
    """The cost component that grew most against the best layout, as a short phrase."""
    if pred is best:
        return "best"
    labels = {"compute": "slower GEMMs", "recompute": "recomputation",
              "tensor_comm": "tensor all-reduces", "pipeline_p2p": "pipeline sends",
              "context_ring": "context ring", "expert_all_to_all": "expert all-to-all",
              "bubble": "pipeline bubble", "dp_exposed": "data-parallel all-reduce",
              "embedding_sync": "embedding sync", "optimizer": "optimizer step"}
    deltas = {k: pred.time.get(k, 0.0) - best.time.get(k, 0.0) for k in labels}
    key = max(deltas, key=deltas.get)
    slower = pred.step_time_s / best.step_time_s - 1
    if deltas[key] <= 0 or slower < 1e-9:
        return "ties on time, more memory" if pred.memory_gb_per_gpu > best.memory_gb_per_gpu else "tie"
    return f"+{slower:.1%}: {labels[key]}"
