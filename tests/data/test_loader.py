"""data.num_workers: micro-batches built ahead by DataLoader workers, the same batches whatever
their number, off the training thread's critical path."""

import time

import torch
import torch.distributed as dist

from ptdp.config import load_config
from ptdp.data.batching import MicroBatches
from ptdp.data.loader import PrefetchedBatches, micro_batch_source
from ptdp.data.synthetic import synthetic_datasets
from ptdp.runtime.local_ranks import run_on_ranks
from tools.bench_data_loading import SlowSamples

SHAPE = ["model.arch=bert", "model.seq_length=16", "model.hidden_size=32", "model.num_heads=4",
         "model.vocab_size=100", "model.num_layers=2"]


def _batches(dataset, context_size: int = 1, context_rank: int = 0) -> MicroBatches:
    return MicroBatches(dataset, global_batch=8, micro_batch_size=2, data_rank=0, data_size=1,
                        device=torch.device("cpu"), context_rank=context_rank,
                        context_size=context_size)


def test_batches_are_the_same_whatever_the_number_of_workers():
    """In the training loop's order, then out of it (asked again, ahead, behind), and a
    context rank's part of each."""
    dataset = synthetic_datasets(load_config(None, SHAPE, world_size=1).model, 3)["train"]
    keys = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 0), (0, 2), (1, 2), (1, 3), (2, 0)]
    for context in ((1, 0), (2, 1)):
        plain = _batches(dataset, *context)
        for workers in (1, 2):
            loaded = micro_batch_source(_batches(dataset, *context), workers)
            for key in keys:
                x, y = plain.get(*key), loaded.get(*key)
                assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), key
            assert (loaded.served, loaded.built_here) == (8, 2)
            loaded.close()
    assert micro_batch_source(plain, 0) is plain


def test_workers_take_data_time_off_the_training_thread():
    """Samples of 25 ms, two per micro-batch: built on the training thread each costs it
    50 ms; with 2 workers the next micro-batches are ready while it computes (here: sleeps
    0.5 s), and taking one costs it less than half of building it: the median of three
    takes, since on a slow machine the first take after a pause was seen at 12-38 ms (above
    the 10 ms mean this test used to allow) while the others took 1-20; built on demand each
    would take the whole 50."""
    dataset = SlowSamples(synthetic_datasets(load_config(None, SHAPE, world_size=1).model, 3)["train"],
                   0.025)
    on_thread = _batches(dataset)
    start = time.perf_counter()
    for mb in range(4):
        on_thread.get(0, mb)
    inline = (time.perf_counter() - start) / 4
    ahead = PrefetchedBatches(_batches(dataset), num_workers=2)
    ahead.get(0, 0)                      # starts the workers
    time.sleep(0.5)                      # the forward and backward of micro-batch 0
    takes = []
    for mb in range(1, 4):
        start = time.perf_counter()
        ahead.get(0, mb)
        takes.append(time.perf_counter() - start)
    ahead.close()
    assert inline >= 0.05 and sorted(takes)[1] < inline / 2, (inline, takes)


def _losses(workers: int) -> tuple[list[float], int | None]:
    from ptdp.training import Trainer
    from tests.equivalence import TINY
    # dropout on: the loader must leave the default generator (the masks' stream) alone
    cfg = load_config(None, TINY + [f"data.num_workers={workers}", "train.iters=2",
                                    "model.dropout=0.1", "log.progress=false"], world_size=1)
    trainer = Trainer(cfg)
    losses = [record["loss"] for record in trainer.train()]
    return losses, getattr(trainer.batches["train"], "served", None)


def test_a_daemonic_process_builds_them_on_a_thread():
    """A rank forked by run_on_ranks is a daemon, which may not start worker processes: one
    thread builds the same batches ahead."""
    assert run_on_ranks(1, _ahead_in_a_daemon, timeout_s=60) == [(True, 8, 0)]


def _ahead_in_a_daemon():
    import multiprocessing
    dataset = synthetic_datasets(load_config(None, SHAPE, world_size=1).model, 3)["train"]
    plain, loaded = _batches(dataset), PrefetchedBatches(_batches(dataset), 2)
    same = all(torch.equal(plain.get(it, mb)["tokens"], loaded.get(it, mb)["tokens"])
               for it in range(2) for mb in range(4))
    daemon = multiprocessing.current_process().daemon
    loaded.close()
    return same and daemon, loaded.served, loaded.built_here


def test_training_with_workers_gives_the_same_losses(monkeypatch):
    """Worker processes under the trainer, in this process as a world of one (torchrun's
    ranks, like this process, are no daemons)."""
    from ptdp.runtime.local_ranks import free_port
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                           WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        (plain, none), (loaded, served) = _losses(0), _losses(2)
    finally:
        dist.destroy_process_group()
    assert none is None and served == 2 * 4
    assert plain == loaded
