"""Tensor x data parallel layouts equal the single-process run (GPT and BERT, fp32)."""

import pytest

from tests.equivalence import assert_equivalent, reference, run_layouts

# world size -> (t, d) layouts of that size
LAYOUTS = {2: [(2, 1), (1, 2)], 4: [(4, 1), (2, 2)], 8: [(4, 2)]}


@pytest.mark.parametrize("arch", ["gpt", "bert"])
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_tensor_data_layouts_match_single_process(arch, world):
    ref = reference(arch)
    runs = [[f"model.arch={arch}", f"parallel.tensor={t}", f"parallel.data={d}"]
            for t, d in LAYOUTS[world]]
    for (t, d), ranks in zip(LAYOUTS[world], run_layouts(world, runs)):
        assert_equivalent(ranks[0], ref, f"{arch} t={t} d={d}")
        # Each tensor rank holds exactly 1/t of every split weight.
        full = ref["weights"]
        for name, shape in ranks[0]["shards"].items():
            if name.endswith(("qkv.weight", "fc1.weight", "fc1.bias", "qkv.bias")):
                assert shape[0] * t == full[name].shape[0], (name, shape)
            if name.endswith(("proj.weight", "fc2.weight")):
                assert shape[1] * t == full[name].shape[1], (name, shape)
            if name == "embedding.word.weight":
                assert shape[0] * t >= full[name].shape[0] and shape[0] % 128 == 0, (name, shape)


def test_loss_is_independent_of_vocab_padding():
    """vocab 100 pads to 128 (t=1) and 512 (t=4); the loss must not see the padding."""
    import math
    ref = reference("gpt")
    assert math.isclose(ref["losses"][0], math.log(100), rel_tol=0.05)
