"""The learning-rate schedule is Megatron-LM's: iteration by iteration, ptdp's rate equals the one
megatron-core's `OptimizerParamScheduler` puts into the optimizer for that iteration, for every
decay style, iteration- and sample-based runs, warm-up fractions and WSD anneals; and every bad
schedule key is refused in one line naming it. (A resumed run continuing on Megatron's schedule:
tests/test_rampup.py, whose resumed run also counts a ramp's samples.)"""

from __future__ import annotations

import pytest

from ptdp.config import ConfigError, load_config
from ptdp.optim.lr import learning_rate

TINY = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.seq_length=16",
        "model.vocab_size=100", "train.micro_batch_size=2", "train.global_batch_size=8",
        "train.lr=1e-2", "train.min_lr=1e-4"]


def megatron_rates(train, iters: int) -> list[float]:
    """The rate of each iteration under Megatron-LM: the scheduler's lengths as its
    `get_optimizer_param_scheduler` (megatron/training/training.py) computes them, `step(0)` at
    construction, then `step(global batch)` after every iteration's update."""
    torch = pytest.importorskip("torch")
    scheduler_module = pytest.importorskip("megatron.core.optimizer_param_scheduler")
    batch = train.global_batch_size
    if train.train_samples is None:   # iteration-based
        decay = (train.lr_decay_iters or train.iters) * batch
        warmup = train.lr_warmup_iters * batch
        wsd = train.lr_wsd_decay_iters * batch if train.lr_wsd_decay_iters else None
    else:
        decay = train.lr_decay_samples or train.train_samples
        warmup = train.lr_warmup_samples
        wsd = train.lr_wsd_decay_samples
    if train.lr_warmup_fraction is not None:
        warmup = train.lr_warmup_fraction * decay
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    style = "WSD" if train.lr_decay_style == "wsd" else train.lr_decay_style
    scheduler = scheduler_module.OptimizerParamScheduler(
        optimizer, init_lr=train.lr_warmup_init, max_lr=train.lr, min_lr=train.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=style,
        start_wd=train.weight_decay, end_wd=train.weight_decay, wd_incr_steps=decay,
        wd_incr_style="constant", wsd_decay_steps=wsd, lr_wsd_decay_style=train.lr_wsd_decay_style)
    rates = []
    for _ in range(iters):
        rates.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=batch)
    return rates


SCHEDULES = {
    "cosine-warmup": ["train.iters=12", "train.lr_warmup_iters=3"],
    "cosine-no-warmup": ["train.iters=5"],
    "linear-shorter-decay": ["train.iters=12", "train.lr_decay_style=linear",
                             "train.lr_warmup_iters=2", "train.lr_decay_iters=8"],
    "constant-warmup-init": ["train.iters=8", "train.lr_decay_style=constant",
                             "train.lr_warmup_iters=3", "train.lr_warmup_init=1e-3"],
    "inverse-square-root": ["train.iters=12", "train.lr_decay_style=inverse-square-root",
                            "train.lr_warmup_iters=2"],
    "inverse-square-root-no-warmup": ["train.iters=6", "train.lr_decay_style=inverse-square-root"],
    "warmup-fraction": ["train.iters=12", "train.lr_warmup_fraction=0.3",
                        "train.lr_decay_iters=10"],
    "samples": ["train.train_samples=100", "train.lr_warmup_samples=20",
                "train.lr_decay_samples=90", "train.lr_decay_style=linear"],
    "samples-fraction": ["train.train_samples=96", "train.lr_warmup_fraction=0.25"],
    **{f"wsd-{style}": ["train.iters=12", "train.lr_decay_style=wsd", "train.lr_warmup_iters=2",
                        f"train.lr_wsd_decay_style={style}", "train.lr_wsd_decay_iters=5"]
       for style in ("exponential", "linear", "cosine", "minus_sqrt")},
    "wsd-samples": ["train.train_samples=100", "train.lr_decay_style=wsd",
                    "train.lr_warmup_samples=10", "train.lr_wsd_decay_samples=36"],
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_iteration_runs_at_megatrons_rate(name):
    train = load_config(None, TINY + SCHEDULES[name], world_size=1).train
    want = megatron_rates(train, train.iters)
    got = [learning_rate(it, train) for it in range(train.iters)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_warmup_starts_at_its_initial_rate_and_the_last_iteration_still_learns():
    train = load_config(None, TINY + ["train.iters=3", "train.lr_warmup_iters=1",
                                      "train.min_lr=0"], world_size=1).train
    assert learning_rate(0, train) == 0.0                     # Megatron's first warm-up step
    assert learning_rate(2, train) > 0.0                      # not one step ahead at min_lr
    assert learning_rate(1, train) == pytest.approx(1e-2)     # the peak after the warm-up


def test_a_warmup_longer_than_the_run_warms_up_then_holds_min_lr():
    # Megatron asserts against it; ptdp keeps short trial runs of a config working
    train = load_config(None, TINY + ["train.iters=2", "train.lr_warmup_iters=4",
                                      "train.lr_decay_iters=3"], world_size=1).train
    assert [learning_rate(it, train) for it in range(5)] == pytest.approx(
        [0.0, 2.5e-3, 5e-3, 7.5e-3, 1e-2])
    assert learning_rate(5, train) == train.min_lr


def test_a_resumed_sample_based_run_says_when_its_decay_stretches():
    from ptdp.checkpoint.load import schedule_change_warning
    meta = {"iteration": 5, "train": {"iters": 12, "train_samples": 100, "lr_decay_samples": None}}
    longer = load_config(None, TINY + ["train.train_samples=200"], world_size=1).train
    warning = schedule_change_warning(meta, longer)
    assert "decay length went from 100 to 200 samples" in warning
    assert "train.lr_decay_samples=100" in warning
    pinned = load_config(None, TINY + ["train.train_samples=200", "train.lr_decay_samples=100"],
                         world_size=1).train
    assert schedule_change_warning(meta, pinned) is None


def test_a_sample_based_run_derives_its_iterations():
    train = load_config(None, TINY + ["train.train_samples=100"], world_size=1).train
    assert train.iters == 100 // 8
    # the written config (iters filled in) validates again unchanged
    again = load_config(None, TINY + ["train.train_samples=100", f"train.iters={train.iters}"],
                        world_size=1).train
    assert again.iters == train.iters


BAD = {
    "train.lr_decay_style=cosin": "train.lr_decay_style: 'cosin' is not one of",
    "train.lr_wsd_decay_style=sqrt": "train.lr_wsd_decay_style: 'sqrt' is not one of",
    "train.lr_warmup_init=0.5": "train.lr_warmup_init must be in [0, train.lr",
    "train.lr_warmup_fraction=1.5": "train.lr_warmup_fraction must be in [0, 1)",
    "train.lr_warmup_fraction=0.1 train.lr_warmup_iters=2":
        "train.lr_warmup_fraction and train.lr_warmup_iters both set the warm-up",
    "train.lr_warmup_samples=16": "train.lr_warmup_samples does not apply: this run is "
                                  "iteration-based",
    "train.train_samples=80 train.lr_decay_iters=4": "train.lr_decay_iters does not apply: this "
                                                     "run is sample-based",
    "train.train_samples=80 train.iters=3": "train.iters (3) and train.train_samples (80) both set",
    "train.train_samples=4": "train.train_samples (4) is less than one global batch",
    "train.train_samples=0": "train.train_samples must be positive",
    "train.lr_decay_style=wsd": "train.lr_decay_style=wsd needs train.lr_wsd_decay_iters",
    "train.lr_decay_style=wsd train.lr_wsd_decay_iters=11": "train.lr_wsd_decay_iters: the anneal",
    "train.lr_wsd_decay_iters=2": "train.lr_wsd_decay_iters applies only to "
                                  "train.lr_decay_style=wsd",
    "train.lr_decay_samples=0": "train.lr_decay_samples must be positive",
}


@pytest.mark.parametrize("overrides", sorted(BAD))
def test_a_bad_schedule_key_is_one_line_naming_it(overrides):
    with pytest.raises(ConfigError) as err:
        load_config(None, TINY + ["train.iters=10"] + overrides.split(), world_size=1)
    assert len(err.value.errors) == 1, err.value.errors
    assert BAD[overrides] in err.value.errors[0]
