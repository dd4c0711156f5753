"""Megatron-LM legacy checkpoints saved with uneven pipelines convert in (ptdp/megatron/legacy.py
with ptdp/megatron/pipeline_layers.py): the layer offsets are megatron-core's own
(`get_transformer_layer_offset`), and a 4-layer GPT saved as stages [1, 3] reads as the whole
model, bit for bit; a ptdp checkpoint of uneven stages converts out like any other."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from tests.megatron import mcore_models as mc  # noqa: E402


@pytest.fixture(scope="module")
def megatron():
    with pytest.MonkeyPatch.context() as mp, mc.cpu_megatron(mp):
        yield


@pytest.mark.parametrize("layers,p,v,first,last", [
    (8, 4, None, 1, 1), (6, 4, None, 0, None), (8, 4, None, None, 2), (8, 2, 2, 2, None), (20, 4, 2, 2, 2),
    (14, 3, 2, 2, None)])
def test_uneven_offsets_are_megatron_cores(megatron, layers, p, v, first, last):
    from argparse import Namespace
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from ptdp.megatron.legacy import layer_offset
    from ptdp.megatron.pipeline_layers import counts_from_args
    config = mc.transformer_config(mc.gpt_args(num_layers=layers))
    config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size = p, v
    config.num_layers_in_first_pipeline_stage = first
    config.num_layers_in_last_pipeline_stage = last
    args = Namespace(num_layers=layers, decoder_first_pipeline_num_layers=first,
                     decoder_last_pipeline_num_layers=last)
    counts = counts_from_args(args, p, v or 1)
    for rank in range(p):
        for chunk in range(v or 1):
            want = get_transformer_layer_offset(config, vp_stage=chunk if v else None,
                                                pp_rank=rank)
            assert layer_offset(layers, p, v or 1, rank, chunk, counts) == want, (rank, chunk)


def test_uneven_legacy_checkpoint_reads_as_the_whole_model(megatron, tmp_path):
    from ptdp.megatron.checkpoint import read_megatron
    args = mc.gpt_args(num_layers=4, pipeline_model_parallel_size=2,
                       decoder_first_pipeline_num_layers=1)
    model = mc.build_gpt(mc.gpt_args(num_layers=4))
    mc.save_legacy(model, mc.gpt_args(num_layers=4), tmp_path / "whole", 3)
    starts = {0: 0, 1: 1}   # stage 0: layer 0; stage 1: layers 1-3, numbered from 0
    stages = {0: {}, 1: {}}
    for name, value in model.state_dict().items():
        if value is None:
            continue
        parts = name.split(".")
        if parts[1] == "layers":
            stage = 0 if int(parts[2]) < 1 else 1
            parts[2] = str(int(parts[2]) - starts[stage])
        else:
            stage = 0 if name.startswith("embedding.") else 1
        stages[stage][".".join(parts)] = value.clone()
    for p, state in stages.items():
        (tmp_path / "uneven" / "iter_0000003" / f"mp_rank_00_{p:03d}").mkdir(parents=True)
        torch.save({"model": state, "args": args, "iteration": 3, "checkpoint_version": 3.0},
                   tmp_path / "uneven" / "iter_0000003" / f"mp_rank_00_{p:03d}" /
                   "model_optim_rng.pt")
    whole = read_megatron(tmp_path / "whole")["state"]
    split = read_megatron(tmp_path / "uneven" / "iter_0000003")["state"]
    assert split.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(split[name], value), name


def test_unholdable_uneven_split_is_refused_in_one_line(megatron, tmp_path):
    from ptdp.megatron.checkpoint import read_megatron
    from ptdp.megatron.errors import MegatronConversionError
    args = mc.gpt_args(num_layers=4, pipeline_model_parallel_size=2,
                       pipeline_model_parallel_layout="E|ttmL")
    model = mc.build_gpt(mc.gpt_args(num_layers=4))
    directory = tmp_path / "iter_0000001"
    for p in range(2):
        (directory / f"mp_rank_00_{p:03d}").mkdir(parents=True)
        torch.save({"model": model.state_dict(), "args": args, "iteration": 1,
                    "checkpoint_version": 3.0}, directory / f"mp_rank_00_{p:03d}" /
                   "model_optim_rng.pt")
    with pytest.raises(MegatronConversionError,
                       match=r"^an uneven pipeline split ptdp cannot hold: m \(an MTP depth\) "
                             r"appears 1 times but --mtp-num-layers is 0: Megatron-LM requires "
                             r"them equal$"):
        read_megatron(directory)


def test_ptdp_uneven_checkpoint_converts_out_and_back(megatron, tmp_path):
    """Megatron (1, 1) -> ptdp at stages [1, 3] -> Megatron (pipeline 2, even): the same
    weights, bit for bit."""
    from ptdp.checkpoint.layout import read_metadata
    from ptdp.megatron.checkpoint import from_megatron, read_megatron, to_megatron_checkpoint
    model = mc.build_gpt(mc.gpt_args(num_layers=4))
    mc.save_legacy(model, mc.gpt_args(num_layers=4), tmp_path / "whole", 3)
    final, cfg, _ = from_megatron(tmp_path / "whole", tmp_path / "ptdp",
                                  ["parallel.pipeline=2", "parallel.stage_layers=[1,3]"])
    stage_of = {name: info["pipeline_rank"] for name, info in read_metadata(final)["params"].items()}
    assert stage_of["layers.0.ln1.weight"] == 0 and stage_of["layers.1.ln1.weight"] == 1
    info = to_megatron_checkpoint(tmp_path / "ptdp", tmp_path / "out", transformer_impl="local",
                                  ckpt_format="torch", pipeline=2)
    whole = read_megatron(tmp_path / "whole")["state"]
    back = read_megatron(info["directory"])["state"]
    assert back.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(back[name], value), name
