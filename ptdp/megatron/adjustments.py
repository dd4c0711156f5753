"""What Megatron-LM changes in its arguments before it trains (megatron/training/arguments.py's
`validate_args`, 0.16.1), applied to a translation with a note each, so the config runs as the
Megatron command line would rather than as its letter says. Also where ptdp's model family
changes what a Megatron argument means (BERT's sample order). Torch-free.
"""

from __future__ import annotations

from ptdp.config.batches import BatchSchedule
from ptdp.config.models import MODEL_FAMILIES, Samples
from ptdp.megatron.converters import APPROXIMATE, REFUSED

NOTE = "note"

# Iteration-counted keys of the learning-rate schedule and their sample-counted twins: Megatron
# counts an iteration-based run's schedule in samples as iterations x global batch
# (megatron/training/training.py `get_optimizer_param_scheduler`).
_IN_SAMPLES = {"train.lr_decay_iters": "train.lr_decay_samples",
               "train.lr_warmup_iters": "train.lr_warmup_samples",
               "train.lr_wsd_decay_iters": "train.lr_wsd_decay_samples"}


def adjust(given: dict, out) -> None:
    """Megatron's run-time adjustments of `given`'s translation `out` (a translate.Translation)."""
    _sequence_parallel_needs_tensor(out)
    _async_save_needs_a_worker(given, out)
    _family_sample_order(out)
    _family_block(out)
    _ramp_in_an_iteration_run(given, out)


def _sequence_parallel_needs_tensor(out) -> None:
    """validate_args: "Disabling sequence parallelism because tensor model parallelism is
    disabled" (it is off whenever --tensor-model-parallel-size is 1)."""
    if out.values.get("parallel.sequence_parallel") and out.values.get("parallel.tensor", 1) == 1:
        origin = out.drop("parallel.sequence_parallel")
        out.note(NOTE, origin, "not written: Megatron-LM turns sequence parallelism off when "
                               "--tensor-model-parallel-size is 1 (its validate_args)")


def _async_save_needs_a_worker(given: dict, out) -> None:
    """validate_args: "--async-save is not supported without --use-persistent-ckpt-worker.
    Disabling --async-save." (with a distributed checkpoint format, torch_dist by default)."""
    if (out.values.get("checkpoint.async_save") and given.get("--ckpt-format") != "torch"
            and "--use-persistent-ckpt-worker" not in given):
        origin = out.drop("checkpoint.async_save")
        out.note(NOTE, origin, "not written: Megatron-LM turns --async-save off without "
                               "--use-persistent-ckpt-worker (its validate_args)")


def _family_sample_order(out) -> None:
    """data.sampling: megatron is GPTDataset's order; a family whose samples are not documents
    (BERT's sentence pairs) keeps ptdp's, as Megatron's own BERT dataset has its own order."""
    family = MODEL_FAMILIES.get(out.values.get("model.arch"))
    if family is None or family.samples is Samples.DOCUMENTS:
        return
    if out.values.get("data.sampling") == "megatron":
        origin = out.drop("data.sampling")
        out.note(NOTE, origin, f"{family.name} keeps ptdp's sample order (data.sampling: ptdp): "
                               f"Megatron's order (data.sampling: megatron) is GPTDataset's, "
                               f"not its {family.name} dataset's")


def _family_block(out) -> None:
    """A family whose block is fixed (BERT: GPT-2's, with the exact GeLU; ptdp/config/models.py
    `block_options`) cannot take Megatron's tanh GeLU or zero-centred norm."""
    family = MODEL_FAMILIES.get(out.values.get("model.arch"))
    if family is None or family.block_options:
        return
    if out.values.get("model.activation") == "gelu_tanh":
        out.note(APPROXIMATE, out.drop("model.activation"),
                 f"Megatron's GeLU here is the tanh approximation; ptdp's {family.name} keeps "
                 f"the exact GeLU of its fixed block")
    if out.values.get("model.norm_zero_centered"):
        out.note(REFUSED, out.drop("model.norm_zero_centered"),
                 f"ptdp's {family.name} keeps the norm of its fixed block", blocks=True)
    if "model.head_dim" in out.values:
        out.note(REFUSED, out.drop("model.head_dim"),
                 f"ptdp's {family.name} keeps the head size of its fixed block "
                 f"(hidden-size / heads)", blocks=True)


def _ramp_in_an_iteration_run(given: dict, out) -> None:
    """A batch ramp with --train-iters: Megatron-LM 0.16.1's validate_args refuses it ("expected
    no batch-size rampup for iteration-based training"); later Megatron-LM runs a step schedule
    in an iteration-based run, counting the learning-rate schedule in samples. ptdp ramps only in
    sample-based runs, so the run becomes the same iterations counted in samples."""
    values = out.values
    ramp, iters = values.get("train.rampup_batch_size"), values.get("train.iters")
    if ramp is None or iters is None or "train.train_samples" in values:
        return
    batch = values.get("train.global_batch_size")
    if batch is None:
        out.note(REFUSED, "train.rampup_batch_size", "needs --global-batch-size", blocks=False)
        out.drop("train.rampup_batch_size")
        return
    schedule = BatchSchedule(batch, ramp)
    samples = schedule.consumed(iters)
    if schedule.iterations_for(samples) != iters:
        out.note(REFUSED, "train.rampup_batch_size", f"the ramp does not end within "
                                                     f"--train-iters {iters}", blocks=False)
        out.drop("train.rampup_batch_size")
        return
    origin = out.drop("train.iters")
    out.set("train.train_samples", samples, f"{origin} with the ramp")
    decay = values.get("train.lr_decay_iters", iters)   # absent, Megatron decays over train-iters
    for key, twin in _IN_SAMPLES.items():
        count = decay if key == "train.lr_decay_iters" else values.get(key)
        if count is not None:
            source = out.drop(key) if key in values else origin
            out.set(twin, int(count) * batch, source)
    out.note(NOTE, origin, f"a batch ramp in an iteration-based run: written as "
                           f"train.train_samples = {samples} (the samples of {iters} iterations) "
                           f"and the learning-rate schedule's iterations x {batch} samples, as "
                           f"Megatron-LM counts them (0.16.1 refuses the pair; later versions "
                           f"run it so)")
