"""Tensor x data parallel layouts equal the single-process run (GPT, BERT, Llama-style; fp32)."""

import math

import pytest

from tests.equivalence import (BLOCKS_LAYOUTS, archs_for, assert_equivalent, layout_result,
                               reference)

TENSOR_DATA = {"t2": (2, 1), "d2": (1, 2), "t4": (4, 1), "t2-d2": (2, 2), "t4-d2": (4, 2)}


@pytest.mark.parametrize("layout,arch", [(lay, a) for lay in TENSOR_DATA for a in archs_for(lay)])
def test_tensor_data_layouts_match_single_process(arch, layout):
    ranks = layout_result(layout, arch)
    assert_equivalent(ranks[0], reference(arch), f"{arch} {layout}")


@pytest.mark.parametrize("layout", BLOCKS_LAYOUTS[1:])
def test_block_options_match_single_process(layout):
    """QK-norm (its gains partial over the tensor group), a head size other than h / heads,
    zero-centred gains, GeGLU and scaled embeddings, with pipeline, tensor, data and
    interleaving."""
    for rank in layout_result(layout, "blocks"):
        assert_equivalent(rank, reference("blocks"), f"blocks {layout}")


@pytest.mark.parametrize("layout", ["t2", "t4"])
def test_each_tensor_rank_holds_one_tth_of_every_split_weight(layout):
    t = TENSOR_DATA[layout][0]
    full = reference("bert")["weights"]
    for rank in layout_result(layout, "bert"):
        for name, shape in rank["shards"].items():
            whole = full[name].shape
            if name.endswith(("qkv.weight", "qkv.bias", "fc1.weight", "fc1.bias")):
                assert shape[0] * t == whole[0] and shape[1:] == whole[1:], name
            elif name.endswith(("proj.weight", "fc2.weight")):
                assert shape[1] * t == whole[1] and shape[0] == whole[0], name
            elif name in ("embedding.word.weight", "heads.lm_bias"):
                assert shape[0] == 128, name  # vocab 100 padded to 128*t, split t ways
            else:
                assert shape == whole, f"{name} should be replicated"


def test_padded_logits_are_masked_out_of_the_loss():
    """vocab 100 is padded to 128 columns; unmasked padding would give ln(128) = 4.85, not ln(100).
    (That the padding, 128*t, does not change training is what the layout tests show.)"""
    assert math.isclose(reference("gpt")["losses"][0], math.log(100), rel_tol=0.02)
