"""PipeDream's hierarchical partitioner (SPEC item 3) against brute-force enumeration."""

import random

import pytest

from ptdp.planner.compute import ModelShape
from ptdp.hardware import load_hardware
from ptdp.planner.partitioner import (Level, LayerProfile, brute_force_time, partition,
                                      transformer_layer_profiles)


def _random_case(rng):
    layers = [LayerProfile(rng.uniform(0.1, 5), rng.uniform(0, 3), rng.uniform(0, 3))
              for _ in range(rng.randint(1, 6))]
    levels = [Level(rng.randint(1, 4), rng.uniform(0.5, 5))]
    if rng.random() < 0.5:
        levels.append(Level(rng.randint(1, 3), rng.uniform(0.2, 2)))
    return layers, levels


def _single_level_time(layers, stages, bandwidth):
    """The objective evaluated directly on a flat partition: slowest stage or boundary."""
    worst = 0.0
    for st in stages:
        compute = sum(l.compute for l in layers[st.first:st.last + 1])
        sync = 2 * (st.replicas - 1) * sum(l.weights for l in layers[st.first:st.last + 1]) / bandwidth
        worst = max(worst, max(compute, sync) / st.replicas)
    for st in stages[:-1]:
        worst = max(worst, 2 * layers[st.last].activation / bandwidth)
    return worst


@pytest.mark.parametrize("seed", range(4))
def test_dynamic_program_matches_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(40):
        layers, levels = _random_case(rng)
        result = partition(layers, levels)
        assert result.time == pytest.approx(brute_force_time(layers, levels), rel=1e-12)


def test_stages_cover_layers_and_devices():
    rng = random.Random(7)
    for _ in range(50):
        layers, levels = _random_case(rng)
        result = partition(layers, levels)
        covered = [i for st in result.stages for i in range(st.first, st.last + 1)]
        assert covered == list(range(len(layers)))
        devices = 1
        for lv in levels:
            devices *= lv.workers
        assert result.devices == devices


def test_flat_partition_achieves_the_reported_time():
    rng = random.Random(11)
    for _ in range(50):
        layers = [LayerProfile(rng.uniform(0.1, 5), rng.uniform(0, 3), rng.uniform(0, 3))
                  for _ in range(rng.randint(1, 7))]
        level = Level(rng.randint(1, 5), rng.uniform(0.5, 5))
        result = partition(layers, [level])
        assert _single_level_time(layers, result.stages, level.bandwidth) == pytest.approx(result.time)


def test_figure_2_7_replicates_the_slow_first_stage():
    # Fig. 2.7: stage 1 takes 2+4 time units, stage 2 takes 1+2; 3 workers -> "2-1".
    # Weights make whole-model data parallelism cost something, as in practice.
    layers = [LayerProfile(6, 0.1, 0.5), LayerProfile(3, 0.1, 0.5)]
    result = partition(layers, [Level(3, 0.2)])
    assert result.config == "2-1"
    assert result.time == pytest.approx(3.0)
    assert result.noam == 2  # ceil(3 workers / 2 input-stage replicas), L1316


def test_straight_pipeline_and_pure_data_parallelism():
    heavy_weights = [LayerProfile(1, 0.01, 100.0) for _ in range(4)]
    straight = partition(heavy_weights, [Level(4, 1.0)])
    assert straight.config == "straight" and straight.noam == 4
    no_weights = [LayerProfile(1, 50.0, 0.0) for _ in range(4)]
    replicated = partition(no_weights, [Level(4, 1.0)])  # boundaries too costly to cut
    assert replicated.config == "4" and replicated.time == pytest.approx(1.0)


def test_hierarchy_multiplies_replication():
    # 2 servers x 4 GPUs: the best server-level plan is replicated over both servers.
    layers = [LayerProfile(4, 0.01, 0.0), LayerProfile(4, 0.01, 0.0)]
    result = partition(layers, [Level(4, 100.0), Level(2, 1.0)])
    assert result.devices == 8
    assert result.time == pytest.approx(1.0)


def test_transformer_profiles_feed_the_partitioner():
    hw = load_hardware("a100-80gb")
    shape = ModelShape("gpt", 6, 1024, 16, 4096, 512, 1000, False)
    layers = transformer_layer_profiles(hw, shape, micro_batch=4, precision="bf16")
    assert len(layers) == 8
    assert layers[1] == layers[6]   # identical transformer layers
    result = partition(layers, [Level(4, 300e9)])
    assert result.devices == 4 and result.time > 0


def test_bad_input():
    with pytest.raises(ValueError):
        partition([], [Level(2, 1.0)])
    with pytest.raises(ValueError):
        partition([LayerProfile(1, 1, 1)], [Level(0, 1.0)])
