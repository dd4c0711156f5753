"""Batch-size ramp-up (train.rampup_batch_size), as Megatron-LM's --rampup-batch-size: each
iteration's batch is megatron-core's calculator's, a sample-based run's length is Megatron's, the
LR counts the ramp's samples, a ramped run in any flushing layout equals the single-process run
of the same ramp, a resumed one continues it exactly (at Megatron's rate), and what cannot ramp
is refused in one line. The same ramped run checks that the schedule, like Megatron's, does not
advance over an update fp16 skipped.
"""

from __future__ import annotations

import pytest
import torch

from ptdp.config import ConfigError, load_config
from ptdp.config.batches import BatchSchedule
from ptdp.optim.lr import learning_rate
from ptdp.runtime.local_ranks import run_on_ranks
from tests.deadline import within

SHAPE = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=4", "model.seq_length=16",
         "model.vocab_size=100", "train.lr=1e-2", "train.adam_eps=1e-3", "train.seed=7",
         "log.progress=false", "train.timeout_s=60"]
# batches 4, 4, then 8: 5 iterations of 32 samples (Megatron's count); micro-batches of 1
RAMP = SHAPE + ["train.micro_batch_size=1", "train.global_batch_size=8",
                "train.rampup_batch_size=[4,4,8]", "train.train_samples=32",
                "train.lr_warmup_samples=6"]


def megatron_ramp(start: int, increment: int, samples: int, batch: int, train_samples: int):
    """(batch of each iteration, iteration count) by megatron-core's calculator, stepped as
    Megatron-LM's training loop and its `update_train_iters` step it."""
    calculators = pytest.importorskip("megatron.core.num_microbatches_calculator")
    calc = calculators.RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size=batch, micro_batch_size=1, data_parallel_size=1,
        decrease_batch_size_if_needed=False, rank=0, start_global_batch_size=start,
        batch_size_increment=increment, ramup_samples=samples)
    iterations, consumed = 0, 0
    while consumed <= samples:
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
        iterations += 1
    iterations += (train_samples - consumed) // batch
    sizes, consumed = [], 0
    for _ in range(iterations):
        calc.update(consumed, consistency_check=False)
        sizes.append(calc.get_current_global_batch_size())
        consumed += sizes[-1]
    return sizes, iterations


@pytest.mark.parametrize("start,increment,samples,batch,train_samples", [
    (4, 4, 8, 8, 32), (32, 32, 1000, 256, 5000), (16, 8, 777, 64, 3000), (8, 8, 100, 16, 101),
    (1, 1, 50, 7, 200)])
def test_each_iterations_batch_and_the_run_length_are_megatrons(start, increment, samples, batch,
                                                                 train_samples):
    want, iterations = megatron_ramp(start, increment, samples, batch, train_samples)
    schedule = BatchSchedule(batch, (start, increment, samples))
    assert schedule.iterations_for(train_samples) == iterations
    assert [schedule.batch_size(it) for it in range(iterations)] == want
    assert [schedule.consumed(it) for it in range(iterations)] == \
        [sum(want[:it]) for it in range(iterations)]


def megatron_rates(skipped: list[bool] | None = None) -> list[float]:
    """RAMP's rate per iteration under Megatron-LM: warm-up over 6 samples, cosine decay over
    train_samples = 32, the scheduler stepped by each iteration's ramped batch, except after an
    iteration whose update was `skipped` (fp16 overflow)."""
    scheduler_module = pytest.importorskip("megatron.core.optimizer_param_scheduler")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = scheduler_module.OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-2, min_lr=0.0, lr_warmup_steps=6,
        lr_decay_steps=32, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0, wd_incr_steps=32,
        wd_incr_style="constant")
    rates = []
    for it, size in enumerate(megatron_ramp(4, 4, 8, 8, 32)[0]):
        rates.append(optimizer.param_groups[0]["lr"])
        if not (skipped and skipped[it]):
            scheduler.step(increment=size)
    return rates


def test_the_learning_rate_counts_the_ramps_samples():
    train = load_config(None, RAMP, world_size=1).train
    assert train.iters == 5
    got = [learning_rate(it, train) for it in range(train.iters)]
    assert got == pytest.approx(megatron_rates(), rel=1e-12)


def _ramped_runs(tmp: str, runs: list) -> dict:
    """Each run's (global batch, loss) per iteration; with `resume`, a run of 2 iterations that
    saves, then one resumed from that checkpoint to the end."""
    from pathlib import Path

    import torch.distributed as dist
    from ptdp.checkpoint.layout import read_metadata
    from ptdp.config import load_config as load
    from ptdp.training import Trainer

    def history(trainer):
        return [(r["global_batch_size"], r["loss"]) for r in trainer.train()]

    def under_nccl_rules(trainer) -> list:
        """history() with the pipeline's exchanges under NCCL's rules (tags ignored, in-order
        completion), as the batch and so m change between iterations."""
        from tests.pipeline.nccl_rules import InOrderTransport
        transport = InOrderTransport(trainer.state.grid.group("pipeline"))
        trainer.pipeline.p2p.transport = transport
        records = history(trainer)
        assert transport.batches > 0
        return records

    def gradients(trainer, it: int) -> tuple:
        """Loss and gradients of iteration `it` at the weights the trainer has (no update)."""
        step = trainer.step.forward_backward(it)
        step.grad_norm = trainer.step.reduce_gradients()
        return step.resolve().loss, trainer.full_state(grads=True)

    def rates_used(trainer) -> list:
        """The learning rate of every optimizer step the trainer takes from now on."""
        rates, optimizer = [], trainer.state.optimizer
        step = optimizer.step
        optimizer.step = lambda: (rates.append(optimizer.param_groups[0]["lr"]), step())[1]
        return rates

    out = {}
    for name, overrides in runs:
        world = dist.get_world_size()
        if name == "gradients":   # iterations 0 and 2 of the ramp vs runs of constant batch
            ramped = Trainer(load(None, RAMP, world_size=world))
            out[name] = [gradients(ramped, 0), gradients(ramped, 2)]
            for batch, it in ((4, 0), (8, 1)):   # samples 0-3, then 8-15
                plain = [o for o in RAMP if not o.startswith(("train.rampup", "train.global"))]
                out[name].append(gradients(Trainer(load(None, plain + [
                    f"train.global_batch_size={batch}"], world_size=world)), it))
            continue
        if name == "fp16":   # the first updates overflow: the schedule waits for them
            trainer = Trainer(load(None, RAMP + overrides, world_size=world))
            rates = rates_used(trainer)
            out[name] = ([r["skipped"] for r in trainer.train()], rates)
            continue
        if name != "resume":
            trainer = Trainer(load(None, RAMP + overrides, world_size=world))
            out[name] = (under_nccl_rules if world > 1 else history)(trainer)
            continue
        ck = [f"checkpoint.dir={tmp}/ck"]
        first = Trainer(load(None, RAMP + ck, world_size=world))
        first.train_step(0), first.train_step(1)   # what train() would do, stopping after 2
        first.state.progress.iteration = 2
        saved = first.save_checkpoint().split()[2]
        out["consumed_at_2"] = read_metadata(Path(saved))["consumed_samples"]
        resumed = Trainer(load(None, RAMP + ck + [f"checkpoint.load={saved}"], world_size=world))
        out["resumed_rates"] = rates_used(resumed)
        out[name] = history(resumed)

    return out


@pytest.fixture(scope="module")
def ramped(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ramp"))
    single = run_on_ranks(1, _ramped_runs, tmp, [
        ("single", []), ("resume", []), ("gradients", []),
        ("fp16", ["train.precision=fp16", f"train.initial_loss_scale={2 ** 21}"])],
        timeout_s=within(120))[0]
    layouts = run_on_ranks(4, _ramped_runs, tmp, [
        ("1f1b", ["parallel.pipeline=2", "parallel.data=2", "train.distributed_optimizer=true"]),
        ("interleaved", ["parallel.pipeline=2", "parallel.data=2", "schedule.name=interleaved",
                         "parallel.chunks=2"]),
        ("zb-h1", ["parallel.pipeline=2", "parallel.tensor=2", "schedule.name=zb-h1"])],
        timeout_s=within(120))[0]
    return {**single, **layouts}


def test_a_ramped_run_trains_the_batches_of_the_ramp(ramped):
    assert [batch for batch, _ in ramped["single"]] == megatron_ramp(4, 4, 8, 8, 32)[0]


@pytest.mark.parametrize("layout", ["1f1b", "interleaved", "zb-h1"])
def test_every_flushing_layout_equals_the_single_process_ramp(ramped, layout):
    want = [loss for _, loss in ramped["single"]]
    assert [batch for batch, _ in ramped[layout]] == [batch for batch, _ in ramped["single"]]
    assert [loss for _, loss in ramped[layout]] == pytest.approx(want, rel=1e-5)


def test_a_ramped_iteration_is_the_mean_over_its_own_batch(ramped):
    """Loss and gradients of the ramp's first iteration (4 samples) equal those of a run whose
    batch is 4, its third (8 samples, after 8) those of a run of 8 at its second: each
    iteration averages over the micro-batches it has, not over the full batch's."""
    first, third, four, eight = ramped["gradients"]
    for ramp, plain in ((first, four), (third, eight)):
        assert ramp[0] == pytest.approx(plain[0], rel=1e-6)
        for name, grad in ramp[1].items():
            assert torch.allclose(grad, plain[1][name], rtol=1e-5, atol=1e-7), name


def test_a_resumed_ramp_continues_exactly_on_megatrons_schedule(ramped):
    assert ramped["consumed_at_2"] == 8   # 4 + 4, not 2 * 8
    resumed, uninterrupted = ramped["resume"], ramped["single"][2:]
    assert [batch for batch, _ in resumed] == [batch for batch, _ in uninterrupted]
    assert ([loss for _, loss in resumed]
            == pytest.approx([loss for _, loss in uninterrupted], rel=1e-5))
    # the rates the resumed optimizer stepped with: Megatron's after 8, 16 and 24 samples
    assert ramped["resumed_rates"] == pytest.approx(megatron_rates()[2:], rel=1e-12)


BAD = {
    "schedule.name=2bw parallel.pipeline=2":
        "train.rampup_batch_size needs a schedule that flushes",
    "train.rampup_batch_size=[3,5,8]": "train.rampup_batch_size: every batch of the ramp must be a "
                                       "multiple of train.micro_batch_size * parallel.data = 2",
    "train.rampup_batch_size=[1,1,8] schedule.name=interleaved parallel.pipeline=2 "
    "parallel.chunks=2":
        "multiple of train.micro_batch_size * parallel.data * parallel.pipeline = 2",
    "train.rampup_batch_size=[4,3,8]": "train.rampup_batch_size: the start (4) must be below "
                                       "train.global_batch_size (8) and reach it in whole "
                                       "increments of 3",
    "train.rampup_batch_size=[4,4]": "train.rampup_batch_size must be three positive integers",
    "train.rampup_batch_size=[4,4,40]": "train.rampup_batch_size: the ramp (40 samples) must end "
                                        "before the run does (train.train_samples = 32)",
    "train.train_samples=null train.lr_warmup_samples=0": "train.rampup_batch_size needs a "
                                                          "sample-based run",
}


@pytest.mark.parametrize("overrides", sorted(BAD))
def test_what_cannot_ramp_is_refused_in_one_line(overrides):
    base = [o for o in RAMP if not o.startswith("train.micro_batch_size")]
    with pytest.raises(ConfigError) as err:
        load_config(None, base + ["train.micro_batch_size=1"] + overrides.split(), world_size=2)
    assert len(err.value.errors) == 1, err.value.errors
    assert BAD[overrides] in err.value.errors[0]


def test_each_iteration_reads_the_samples_after_the_ramps_earlier_batches():
    import numpy as np
    from ptdp.data.batching import MicroBatches
    schedule = BatchSchedule(8, (4, 2, 10))   # batches 4, 4, 6, then 8
    dataset = [{"tokens": np.array([i])} for i in range(1000)]
    ranks = [MicroBatches(dataset, global_batch=8, micro_batch_size=1, data_rank=r, data_size=2,
                          device=torch.device("cpu"), schedule=schedule) for r in range(2)]
    for it in range(6):
        read = [int(ranks[r].build(it, mb)["tokens"]) for r in range(2)
                for mb in range(ranks[r].schedule.batch_size(it) // 2)]
        first = schedule.consumed(it)
        assert read == list(range(first, first + schedule.batch_size(it)))
    # the order the data-loader workers build micro-batches in: (iteration, micro-batch) in turn
    keys = [(it, mb) for it in range(6) for mb in range(ranks[0].schedule.batch_size(it) // 2)]
    assert [ranks[0].key_at(ranks[0].order(*key)) for key in keys] == keys
    assert [ranks[0].order(*key) for key in keys] == list(range(len(keys)))


def test_the_schedule_stands_still_on_an_update_fp16_skipped(ramped):
    skipped, rates = ramped["fp16"]
    assert skipped[:2] == [True, True] and not any(skipped[2:])
    megatron = megatron_rates(skipped)
    assert rates == pytest.approx([r for r, s in zip(megatron, skipped) if not s], rel=1e-12)
    assert rates[0] == 0.0   # still the warm-up's first rate after two skipped iterations


def test_a_resumed_run_says_when_its_batches_would_have_read_other_samples():
    from ptdp.checkpoint.load import batch_change_warning
    train = load_config(None, RAMP, world_size=1).train
    assert batch_change_warning({"iteration": 3, "consumed_samples": 16}, train) is None
    unramped = {"iteration": 3, "consumed_samples": 24}   # saved by a run of constant B = 8
    assert "consumed 24 samples in its 3 iterations" in batch_change_warning(unramped, train)
    assert "continue from 16" in batch_change_warning(unramped, train)


def test_megatron_sampling_builds_train_samples_for_a_sample_based_run():
    from ptdp.data.build import num_samples_needed
    cfg = load_config(None, RAMP, world_size=1)
    schedule = BatchSchedule.of(cfg.train)
    assert num_samples_needed(cfg)["train"] == 32 >= schedule.consumed(cfg.train.iters)
    plain = load_config(None, SHAPE + ["train.iters=3", "train.global_batch_size=8"], world_size=1)
    assert num_samples_needed(plain)["train"] == 24
