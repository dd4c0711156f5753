"""The checks of how long a run is and how it moves along: train.iters or train.train_samples
(Megatron's sample-based runs), the learning-rate schedule's keys (ptdp/optim/lr.py) and the
batch ramp-up (train.rampup_batch_size, ptdp/config/batches.py). One line per problem, naming
the key, as the rest of ptdp/config/validation.py."""

from __future__ import annotations

from ptdp.config.batches import BatchSchedule
from ptdp.config.catalogue import ScheduleSpec, names_where
from ptdp.config.problems import Problems
from ptdp.config.schema import (LR_DECAY_STYLES, LR_WSD_DECAY_STYLES, Config, TrainConfig,
                                schedule_lengths)


def check_run_length_and_schedule(tr: TrainConfig, out: Problems) -> bool:
    """The ramp's shape, the run's length (fills train.iters of a sample-based run) and the
    learning-rate keys; False if the ramp cannot be used in the layout checks."""
    ramp_ok = _check_rampup_shape(tr, out)
    _check_learning_rate(tr, out, ramp_ok)
    return ramp_ok


def _check_rampup_shape(tr: TrainConfig, out: Problems) -> bool:
    """train.rampup_batch_size: [start, increment, ramp_samples] as integers (normalised here),
    start < B reachable by whole increments, in a sample-based run (Megatron's rule)."""
    ramp = tr.rampup_batch_size
    if ramp is None:
        return True
    key = "train.rampup_batch_size"
    try:
        values = [int(str(v)) for v in ramp]
    except ValueError:
        values = []
    if not out.require(len(values) == 3 and min(values) > 0,
                       f"{key} must be three positive integers [start, increment, ramp_samples], "
                       f"got {ramp}"):
        return False
    tr.rampup_batch_size = values
    start, increment, samples = values
    reachable = start < tr.global_batch_size and (tr.global_batch_size - start) % increment == 0
    return all([
        out.require(reachable,
                    f"{key}: the start ({start}) must be below train.global_batch_size "
                    f"({tr.global_batch_size}) and reach it in whole increments of {increment}"),
        out.require(tr.train_samples is None or samples < tr.train_samples,
                    f"{key}: the ramp ({samples} samples) must end before the run does "
                    f"(train.train_samples = {tr.train_samples})"),
        out.require(tr.train_samples is not None,
                    f"{key} needs a sample-based run: set train.train_samples (Megatron ramps the "
                    f"batch only then)")])


def _check_learning_rate(tr: TrainConfig, out: Problems, ramp_ok: bool = True) -> None:
    out.positive(tr.lr, "train.lr", strict=False)
    out.positive(tr.min_lr, "train.min_lr", strict=False)
    if tr.lr >= 0 and tr.min_lr >= 0:
        out.require(tr.min_lr <= tr.lr,
                    f"train.min_lr ({tr.min_lr}) must not exceed train.lr ({tr.lr})")
    out.require(0.0 <= tr.lr_warmup_init <= max(tr.lr, 0.0),
                f"train.lr_warmup_init must be in [0, train.lr = {tr.lr}], got {tr.lr_warmup_init}")
    for key in ("lr_warmup_iters", "lr_warmup_samples"):
        out.positive(getattr(tr, key), f"train.{key}", strict=False)
    for key in ("lr_decay_iters", "lr_decay_samples", "lr_wsd_decay_iters", "lr_wsd_decay_samples"):
        if getattr(tr, key) is not None:
            out.positive(getattr(tr, key), f"train.{key}", hint=" (null: the default)")
    styles_ok = all([out.choice(tr.lr_decay_style, LR_DECAY_STYLES, "train.lr_decay_style"),
                     out.choice(tr.lr_wsd_decay_style, LR_WSD_DECAY_STYLES,
                                "train.lr_wsd_decay_style")])
    fraction_ok = _check_warmup_fraction(tr, out)
    if _check_counting(tr, out, ramp_ok) and styles_ok and fraction_ok and tr.iters > 0 \
            and tr.global_batch_size >= 1:   # (a bad batch size is its own line)
        _check_lengths(tr, out)


def _check_warmup_fraction(tr: TrainConfig, out: Problems) -> bool:
    if tr.lr_warmup_fraction is None:
        return True
    given = [f"train.{key}" for key in ("lr_warmup_iters", "lr_warmup_samples") if getattr(tr, key)]
    return all([out.require(0.0 <= tr.lr_warmup_fraction < 1.0,
                            f"train.lr_warmup_fraction must be in [0, 1) (a fraction of the decay "
                            f"length), got {tr.lr_warmup_fraction}"),
                out.require(not given, f"train.lr_warmup_fraction and {given[0] if given else ''} "
                                       f"both set the warm-up: set one of them")])


# The keys that count iterations, and their sample-counting twins (train.train_samples runs).
_ITERATION_KEYS = {"lr_warmup_iters": "lr_warmup_samples", "lr_decay_iters": "lr_decay_samples",
                   "lr_wsd_decay_iters": "lr_wsd_decay_samples"}


def _check_counting(tr: TrainConfig, out: Problems, ramp_ok: bool) -> bool:
    """Iteration-based runs take the *_iters keys, sample-based runs (train.train_samples) the
    *_samples keys (Megatron's rule); fills train.iters of a sample-based run."""
    by_samples = tr.train_samples is not None
    run = ("sample-based (train.train_samples is set)" if by_samples
           else "iteration-based (train.train_samples is null)")
    ok = True
    for iters_key, samples_key in _ITERATION_KEYS.items():
        wrong, right = (iters_key, samples_key) if by_samples else (samples_key, iters_key)
        ok = out.require(not getattr(tr, wrong), f"train.{wrong} does not apply: this run is "
                                                 f"{run}; use train.{right}") and ok
    if by_samples:
        ok = out.positive(tr.train_samples, "train.train_samples",
                          hint=" (null: an iteration-based run, train.iters)") \
            and ramp_ok and _derive_iters(tr, out) and ok
    return ok


def _derive_iters(tr: TrainConfig, out: Problems) -> bool:
    """train.iters from train.train_samples (Megatron's `update_train_iters`: whole global
    batches; with a ramp, its iterations and then whole global batches)."""
    if tr.global_batch_size < 1:
        return False
    derived = BatchSchedule.of(tr).iterations_for(tr.train_samples)
    if not out.require(tr.iters in (TrainConfig.iters, derived),
                       f"train.iters ({tr.iters}) and train.train_samples ({tr.train_samples}) "
                       f"both set the run's length (train.train_samples makes it {derived} "
                       f"iterations): remove train.iters, or set it to {derived}"):
        return False
    tr.iters = derived
    return out.require(derived >= 1, f"train.train_samples ({tr.train_samples}) is less than one "
                                     f"global batch (train.global_batch_size = "
                                     f"{tr.global_batch_size})")


def _check_lengths(tr: TrainConfig, out: Problems) -> None:
    """WSD's anneal inside the decay. (A warm-up as long as the decay or longer, which Megatron
    asserts against, is accepted: the rate warms up, then holds min_lr; short trial runs of a
    config, `train.iters=2`, keep working.)"""
    span = schedule_lengths(tr)
    decay_keys = ("train.lr_decay_samples or train.train_samples" if tr.train_samples is not None
                  else "train.lr_decay_iters or train.iters")
    wsd_key = ("train.lr_wsd_decay_samples" if tr.train_samples is not None
               else "train.lr_wsd_decay_iters")
    if tr.lr_decay_style != "wsd":
        out.require(span.wsd_decay is None, f"{wsd_key} applies only to "
                                            f"train.lr_decay_style=wsd (got {tr.lr_decay_style})")
    elif out.require(span.wsd_decay is not None, f"train.lr_decay_style=wsd needs {wsd_key} "
                                                 f"(the length of the final anneal)"):
        unit, per = ("samples", 1) if tr.train_samples is not None \
            else ("iterations", tr.global_batch_size)   # say it in the keys' own unit
        out.require(span.wsd_decay <= span.decay,
                    f"{wsd_key}: the anneal ({span.wsd_decay // per} {unit}) must fit in the "
                    f"decay length ({span.decay // per} {unit}: {decay_keys})")


def check_rampup_layout(cfg: Config, spec: ScheduleSpec, out: Problems) -> None:
    """A ramped batch changes m between iterations: only schedules that flush take that (the
    no-flush streams plan iterations of one m), and every batch of the ramp must split into
    whole micro-batches (interleaved: groups of p) on every data rank."""
    tr, d, p = cfg.train, cfg.parallel.data, cfg.parallel.pipeline
    key = "train.rampup_batch_size"
    if not out.require(spec.flushing, f"{key} needs a schedule that flushes (m changes between "
                                      f"iterations): use schedule.name="
                                      f"{' or '.join(names_where(lambda s: s.flushing))}, not "
                                      f"{spec.name}"):
        return
    start, increment, _ = tr.rampup_batch_size
    grouped = spec.interleaves(cfg.parallel.chunks)   # micro-batches go in groups of p
    unit = tr.micro_batch_size * d * (p if grouped else 1)
    what = "train.micro_batch_size * parallel.data" + (" * parallel.pipeline" if grouped else "")
    out.require(start % unit == 0 and increment % unit == 0,
                f"{key}: every batch of the ramp must be a multiple of {what} = {unit}; the start "
                f"({start}) and the increment ({increment}) must be")
