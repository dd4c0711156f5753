"""Converters of the rows ptdp/megatron/arguments.py gained for Megatron-LM's example scripts
(examples/*/train_*.sh): the GeLU flavours, low-precision formats, gradient reduction in bf16
and the batch-size schedule. The conventions are ptdp/megatron/converters.py's. Torch-free."""

from __future__ import annotations

from ptdp.megatron.converters import IGNORED, REFUSED, Default, Differs, Unmapped


# GeLU ------------------------------------------------------------------------------------------

_NOT_GELU = ("--swiglu", "--squared-relu", "--quick-geglu")


def _fused_bias_gelu(given: dict) -> bool:
    """Megatron's MLP runs its fused bias-GeLU, the tanh approximation
    (megatron/core/fusions/fused_bias_gelu.py), for a GeLU MLP with biases unless
    --no-bias-gelu-fusion (validate_args turns the fusion off without biases)."""
    return not any(f in given for f in _NOT_GELU + ("--disable-bias-linear",
                                                     "--no-bias-gelu-fusion"))


def gelu_fusion(value, given):
    """--no-bias-gelu-fusion given (True): Megatron's exact GeLU, ptdp's default; absent
    (False, the default below): the fused tanh GeLU, model.activation: gelu_tanh."""
    return {} if value is True else {"model.activation": "gelu_tanh"}


GELU_FUSION_DEFAULT = Default(lambda given: False if _fused_bias_gelu(given) else None,
                              "the fused bias-GeLU: model.activation gelu_tanh")


def head_size(value, given):
    """--kv-channels: the head size; written only where it is not hidden-size / heads (ptdp's
    model.head_dim default), as Megatron's projections are heads x kv-channels wide."""
    h, heads = given.get("--hidden-size"), given.get("--num-attention-heads")
    if h is not None and heads is not None and int(value) * int(heads) == int(h):
        return {}
    return int(value)


def low_precision(name: str):
    """--fp8-format / --fp4-format: ptdp trains in the precision of --bf16 / --fp16 instead."""
    def convert(value, given):
        precision = "bf16" if "--bf16" in given else "fp16" if "--fp16" in given else "fp32"
        return Differs({}, f"ptdp has no {name} matrix multiplications: trains in {precision}")
    return convert


def grad_reduce_in_bf16(value, given):
    if "--bf16" not in given:
        raise Unmapped(IGNORED, "Megatron reduces in bf16 only with --bf16")
    return Differs("bf16", "Megatron also accumulates the micro-batch gradients in bf16; ptdp "
                           "accumulates in fp32 and reduces in bf16")


def partial_load(key: str, value, what: str):
    """--no-load-optim, --no-load-rng, --finetune: part of the checkpoint --load names. ptdp
    loads part only of a named checkpoint; its own (--load = --save: checkpoint.load auto)
    always resume whole (ptdp/config/validation.py)."""
    def convert(flag_value, given):
        load = given.get("--load")
        if load is None:
            raise Unmapped(IGNORED, "Megatron uses it only with --load")
        if load == given.get("--save"):
            return Differs({}, f"--load is --save (checkpoint.load: auto): ptdp resumes its own "
                               f"checkpoints whole, where Megatron restarts {what}; to start "
                               f"from another checkpoint so, set checkpoint.load to it and "
                               f"checkpoint.{key.split('.')[1]}")
        return {key: value}
    return convert


# The batch-size schedule ----------------------------------------------------------------------

_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def _count(text: str) -> int:
    """Megatron's `_parse_numeric_value`: 2.4B -> 2400000000."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def step_schedule(value, given):
    """--step-batch-size-schedule "0:16 2.4B:320 ...": thresholds in tokens (Megatron divides
    them by --seq-length) -> train.rampup_batch_size where the steps are Megatron's ramp-up rule
    (equal increments at equal intervals, megatron-core's num_microbatches_calculator.py);
    other schedules are refused."""
    words = " ".join(value if isinstance(value, list) else [value]).replace(",", " ").split()
    seq = given.get("--seq-length", given.get("--encoder-seq-length"))
    if seq is None:
        raise Unmapped(REFUSED, "needs --seq-length: the thresholds count tokens")
    try:
        steps = sorted((_count(t) // int(seq), _count(b))
                       for t, b in (word.split(":", 1) for word in words))
    except ValueError:
        raise Unmapped(REFUSED, "not THRESHOLD:BATCH pairs") from None
    final = steps[-1][1]
    gbs = given.get("--global-batch-size")
    if gbs is not None and int(gbs) != final:
        raise Unmapped(REFUSED, f"its last batch size ({final}) differs from --global-batch-size "
                                f"({gbs})")
    if len(steps) == 1:
        return {"train.global_batch_size": final}
    ramp = _as_ramp(steps)
    if ramp is None:
        raise Unmapped(REFUSED, "ptdp's batch ramp (train.rampup_batch_size) grows by equal "
                                "increments at equal sample intervals; this schedule does not")
    return {"train.rampup_batch_size": ramp, "train.global_batch_size": final}


def _as_ramp(steps: list[tuple[int, int]]) -> list[int] | None:
    """[start, increment, ramp_samples] whose ramp-up takes exactly these steps, else None."""
    (first, start), n = steps[0], len(steps) - 1
    increment, ramp_samples = steps[1][1] - start, steps[-1][0]
    if first != 0 or increment <= 0 or any(b != start + k * increment
                                           for k, (_, b) in enumerate(steps)):
        return None

    def batch(consumed: int) -> int:   # megatron-core's RampupBatchsize rule
        if consumed > ramp_samples:
            return start + n * increment
        return start + int(consumed / (ramp_samples / n)) * increment

    exact = all(batch(t) == b and batch(t - 1) == start + (k - 1) * increment
                for k, (t, b) in enumerate(steps) if k > 0)
    return [start, increment, ramp_samples] if exact else None
