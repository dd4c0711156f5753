"""DeepSeek-V3's multi-token-prediction layer <-> ptdp's prediction depths (ptdp/hf/mtp.py).

The tiny DeepseekV3ForCausalLM of tests/hf/test_deepseek.py (interleaved rotary rows, experts
in groups with selection biases, a shared expert), saved by transformers, gets a random MTP
layer `model.layers.4.*` in its safetensors the way DeepSeek's release holds one (a decoder
layer with experts per expert, enorm, hnorm, eh_proj, shared_head.norm, and copies of the
model's embedding and lm_head). It imports as model.mtp_layers = 1: the depth's own weights are
the file's, its decoder layer is what ptdp makes of the same tensors in a decoder layer, its
loss is DeepSeek's formula computed here from the file's tensors; ptdp -> HF -> ptdp is
bit-identical and transformers loads the export. Copies that differ, missing or extra tensors
and some of the layers only are refused in one line; no layers at all converts without."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.optional import needs
transformers = needs("transformers")

from tests.hf.hf_models import logits_diff  # noqa: E402
from tests.hf.test_deepseek import DEEPSEEK, _hf_dir  # noqa: E402

LAYER = "model.layers.4."   # the MTP layer: num_hidden_layers + 0
_MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "shared_head.head.weight", "embed_tokens.weight")


def _file(path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def _save(path, tensors: dict) -> None:
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              {"format": "pt"})


def _random_layer(main: dict, seed: int = 11) -> dict:
    """A random MTP layer as DeepSeek releases it: layer 3's tensors' names and shapes under
    layer 4, new values (gains near 1), plus its own and copied weights."""
    g = torch.Generator().manual_seed(seed)
    noise = lambda t, std=0.1: std * torch.randn(t.shape, generator=g)   # noqa: E731
    out = {}
    for name, value in main.items():
        if name.startswith("model.layers.3."):
            new = LAYER + name[len("model.layers.3."):]
            out[new] = (1 + noise(value) if "norm" in name else
                        noise(value, 0.05) if name.endswith("bias") else noise(value))
    h = main["model.norm.weight"].shape[0]
    out.update({LAYER + "enorm.weight": 1 + noise(torch.empty(h)),
                LAYER + "hnorm.weight": 1 + noise(torch.empty(h)),
                LAYER + "eh_proj.weight": noise(torch.empty(h, 2 * h)),
                LAYER + "shared_head.norm.weight": 1 + noise(torch.empty(h)),
                LAYER + "shared_head.head.weight": main["lm_head.weight"].clone(),
                LAYER + "embed_tokens.weight": main["model.embed_tokens.weight"].clone()})
    return out


def _with_layer(path, **keys):
    """(transformers' model, the MTP layer's tensors) of a tiny DeepSeek-V3 saved in `path`
    with an MTP layer added to its safetensors."""
    model = _hf_dir(path, **{**DEEPSEEK, "num_nextn_predict_layers": 1, **keys})
    main = _file(path)
    layer = _random_layer(main)
    _save(path, {**main, **layer})
    return model, layer


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The tiny model with its MTP layer, converted to (p, t) = (2, 2) and back to HF."""
    from ptdp.hf.convert import from_hf, to_hf
    root = tmp_path_factory.mktemp("mtp")
    model, layer = _with_layer(root / "hf")
    _, cfg = from_hf(root / "hf", root / "ptdp", ["parallel.tensor=2", "parallel.pipeline=2"])
    to_hf(root / "ptdp", root / "back")
    return dict(root=root, model=model, layer=layer, cfg=cfg)


def test_the_layer_imports_as_a_prediction_depth(imported, tmp_path):
    """The depth's own weights are the file's; its decoder layer (rotary rows, experts, router,
    shared expert, selection bias) is what ptdp makes of the same tensors as layer 3."""
    from ptdp.hf.convert import from_hf
    from ptdp.inference.local_model import read_full_state
    assert imported["cfg"].model.mtp_layers == 1
    _, meta, state = read_full_state(imported["root"] / "ptdp")
    layer = imported["layer"]
    for ours, theirs in [("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                         ("final_ln", "shared_head.norm")]:
        assert torch.equal(state[f"mtp.0.{ours}.weight"], layer[f"{LAYER}{theirs}.weight"]), ours
    # the twin: the same tensors as decoder layer 3 of a model without MTP
    twin = tmp_path / "twin"
    _hf_dir(twin, **{**DEEPSEEK, "num_nextn_predict_layers": 0})
    main = {k: v for k, v in _file(twin).items() if not k.startswith("model.layers.3.")}
    main.update({"model.layers.3." + k[len(LAYER):]: v for k, v in layer.items()
                 if not k.endswith(_MTP_OWN)})
    _save(twin, main)
    from_hf(twin, tmp_path / "twin_ptdp")
    _, twin_meta, twin_state = read_full_state(tmp_path / "twin_ptdp")
    decoder = {k[len("mtp.0.layer."):]: v for k, v in state.items()
               if k.startswith("mtp.0.layer.")}
    assert len(decoder) == len([k for k in twin_state if k.startswith("layers.3.")]) == 28
    for name, value in decoder.items():
        assert torch.equal(value, twin_state[f"layers.3.{name}"]), name
    biases = meta["moe"]["expert_bias"]
    assert biases["4"] == twin_meta["moe"]["expert_bias"]["3"]
    assert biases["4"] == layer[LAYER + "mlp.gate.e_score_correction_bias"].tolist()


def test_ptdp_to_hf_to_ptdp_is_bit_identical(imported, tmp_path):
    from ptdp.hf.convert import from_hf
    from ptdp.inference.local_model import LocalModel, read_full_state
    root = imported["root"]
    back = _file(root / "back")
    assert json.loads((root / "back" / "config.json").read_text())[
        "num_nextn_predict_layers"] == 1
    for copy, original in [("embed_tokens.weight", "model.embed_tokens.weight"),
                           ("shared_head.head.weight", "lm_head.weight")]:
        assert torch.equal(back[LAYER + copy], back[original])
    assert {k for k in back if k.startswith(LAYER)} == set(imported["layer"])   # as released
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(root / "back")).eval()
    ours = LocalModel.from_checkpoint(root / "ptdp")
    assert logits_diff(ours, hf, 128, 16) < 1e-5   # (transformers ignores the MTP layer)
    from_hf(root / "back", tmp_path / "again", ["parallel.tensor=2", "parallel.pipeline=2"])
    _, meta, state = read_full_state(root / "ptdp")
    _, meta_again, again = read_full_state(tmp_path / "again")
    assert set(state) == set(again) and any(k.startswith("mtp.0.") for k in state)
    for name, value in state.items():
        assert torch.equal(value, again[name]), name
    assert meta["moe"] == meta_again["moe"]


def _reference_loss(hf, layer: dict, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP module from the file's tensors, in plain torch and transformers'
    DeepseekV3DecoderLayer: at position i, h' = eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)]) (h:
    the model's output after its final norm), one decoder layer (causal, rotary positions from
    0, its rotary rows as the file holds them), shared_head.norm, shared_head.head, and the
    cross-entropy against t_{i+2}, averaged over the positions whose target counts."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling
    t = lambda name: layer[LAYER + name]   # noqa: E731
    rms = lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    s = seq.shape[1] - 2                   # the positions with a token two ahead
    config = hf.config
    config._attn_implementation = "eager"
    block = modeling.DeepseekV3DecoderLayer(config, layer_idx=4).eval()
    experts = range(config.n_routed_experts)
    weights = {k[len(LAYER):]: v for k, v in layer.items()
               if not k.endswith(_MTP_OWN) and ".experts." not in k}
    weights["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([t(f"mlp.experts.{e}.gate_proj.weight"), t(f"mlp.experts.{e}.up_proj.weight")])
         for e in experts])
    weights["mlp.experts.down_proj"] = torch.stack(
        [t(f"mlp.experts.{e}.down_proj.weight") for e in experts])
    block.load_state_dict(weights, strict=True)
    with torch.no_grad():
        h = hf.model(seq[:, :s]).last_hidden_state
        emb = F.embedding(seq[:, 1:s + 1], t("embed_tokens.weight"))
        x = F.linear(torch.cat([rms(emb, t("enorm.weight")), rms(h, t("hnorm.weight"))], -1),
                     t("eh_proj.weight"))
        positions = torch.arange(s)[None].expand(seq.shape[0], -1)
        causal = torch.full((s, s), float("-inf")).triu(1)[None, None].expand(seq.shape[0], 1,
                                                                                -1, -1)
        out = block(x, attention_mask=causal, position_ids=positions,
                    position_embeddings=modeling.DeepseekV3RotaryEmbedding(config)(x, positions))
        logits = F.linear(rms(out, t("shared_head.norm.weight")), t("shared_head.head.weight"))
        ce = F.cross_entropy(logits.flatten(0, 1), seq[:, 2:].flatten(), reduction="none")
        counts = mask[:, 1:s + 1].flatten()
        return (ce * counts).sum() / counts.sum()


def test_the_depths_loss_is_deepseeks_mtp_loss(imported):
    """ptdp's side output mtp_1 (models/mtp.py: λ/D · L_1) against DeepSeek's formula on the
    Hugging Face tensors."""
    from ptdp.data.batching import future_targets
    from ptdp.inference.local_model import LocalModel
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 128, (2, 17), generator=g)
    batch = {"tokens": seq[:, :-1], "labels": seq[:, 1:],
             "loss_mask": (torch.rand(2, 16, generator=g) > 0.2).float()}
    batch.update(future_targets(batch, 1))
    ours = LocalModel.from_checkpoint(imported["root"] / "ptdp")
    with torch.no_grad():
        got = ours.chunk(None, batch).aux_losses["mtp_1"]
    m = imported["cfg"].model
    expected = m.mtp_loss_scale / m.mtp_layers * _reference_loss(
        imported["model"], imported["layer"], seq, batch["loss_mask"])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("change, line", [
    (lambda f: f.update({LAYER + "embed_tokens.weight": f[LAYER + "embed_tokens.weight"] + 1}),
     f"'{LAYER}embed_tokens.weight' differs from 'model.embed_tokens.weight': ptdp's "
     f"prediction depths share the model's embedding"),
    (lambda f: f.update({LAYER + "shared_head.head.weight": f["lm_head.weight"] * 2}),
     f"'{LAYER}shared_head.head.weight' differs from 'lm_head.weight': ptdp's prediction "
     f"depths share the model's output layer"),
    (lambda f: f.pop(LAYER + "hnorm.weight"),
     f"the Hugging Face weights have no '{LAYER}hnorm.weight'"),
    (lambda f: f.pop(LAYER + "mlp.experts.5.up_proj.weight"),
     f"the Hugging Face weights have no '{LAYER}mlp.experts.5.up_proj.weight'"),
    (lambda f: f.update({LAYER + "eh_proj.weight_scale_inv": torch.ones(1)}),
     f"the Hugging Face weights hold 1 tensor(s) of the prediction layer {LAYER}* that ptdp "
     f"has no place for, the first '{LAYER}eh_proj.weight_scale_inv'"),
], ids=["embedding", "head", "missing", "missing-expert", "extra"])
def test_what_ptdp_cannot_carry_is_refused(change, line, tmp_path):
    from ptdp.hf.base import ConversionError
    from ptdp.hf.convert import from_hf
    _with_layer(tmp_path / "hf")
    tensors = _file(tmp_path / "hf")
    change(tensors)
    _save(tmp_path / "hf", tensors)
    with pytest.raises(ConversionError) as err:
        from_hf(tmp_path / "hf", tmp_path / "ptdp")
    assert str(err.value) == line
    assert not (tmp_path / "ptdp").exists()


def test_some_of_the_layers_only_is_refused(tmp_path):
    from ptdp.hf.base import ConversionError
    from ptdp.hf.convert import from_hf
    _with_layer(tmp_path / "hf", num_nextn_predict_layers=2)
    with pytest.raises(ConversionError) as err:
        from_hf(tmp_path / "hf", tmp_path / "ptdp")
    assert str(err.value) == ("config.json has num_nextn_predict_layers=2, but the safetensors "
                              "hold 1 of those layers (model.layers.4.)")


def test_no_layers_in_the_files_converts_without_and_says_so(tmp_path, capsys):
    """transformers writes num_nextn_predict_layers (1 by default) but not the layers."""
    from ptdp.hf.convert import from_hf
    _hf_dir(tmp_path / "hf", **{**DEEPSEEK, "num_nextn_predict_layers": 1})
    _, cfg = from_hf(tmp_path / "hf", tmp_path / "ptdp")
    assert cfg.model.mtp_layers == 0
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{tmp_path / 'hf'}: config.json has num_nextn_predict_layers=1, but the safetensors "
        f"hold no 'model.layers.4.*': converted without multi-token prediction "
        f"(model.mtp_layers=0)"]


def test_sharded_weights_read_and_write_through_the_index(imported, tmp_path):
    """DeepSeek's release is sharded (model.safetensors.index.json): the layer is found by the
    index, and written into the last shard and the index."""
    from ptdp.hf.convert import from_hf
    from ptdp.hf.mtp import INDEX, write_depths
    from ptdp.inference.local_model import read_full_state
    imported["model"].save_pretrained(str(tmp_path / "hf"), max_shard_size="100KB")
    write_depths(tmp_path / "hf", imported["layer"])
    index = json.loads((tmp_path / "hf" / INDEX).read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    assert len(set(index["weight_map"].values())) > 1
    assert {index["weight_map"][name] for name in imported["layer"]} == {last}
    from_hf(tmp_path / "hf", tmp_path / "ptdp")
    _, _, state = read_full_state(tmp_path / "ptdp")
    _, _, first = read_full_state(imported["root"] / "ptdp")
    assert all(torch.equal(value, first[name]) for name, value in state.items())


def test_a_dense_model_with_its_layer_round_trips(tmp_path):
    from ptdp.hf.convert import from_hf, to_hf
    from ptdp.inference.local_model import read_full_state
    _, layer = _with_layer(tmp_path / "hf", first_k_dense_replace=4, q_lora_rank=None)
    assert LAYER + "mlp.gate_proj.weight" in layer
    _, cfg = from_hf(tmp_path / "hf", tmp_path / "ptdp", ["model.mtp_loss_scale=0.3"])
    assert (cfg.model.mtp_layers, cfg.model.mtp_loss_scale) == (1, 0.3)   # λ: training's
    to_hf(tmp_path / "ptdp", tmp_path / "back")
    from_hf(tmp_path / "back", tmp_path / "again")
    _, _, state = read_full_state(tmp_path / "ptdp")
    _, _, again = read_full_state(tmp_path / "again")
    assert torch.equal(state["mtp.0.layer.mlp.fc2.weight"], layer[LAYER + "mlp.down_proj.weight"])
    assert set(state) == set(again) and all(torch.equal(v, again[k]) for k, v in state.items())


def test_a_class_without_the_layers_is_written_without_them_and_says_so(tmp_path, capsys):
    """A Llama-style model with a prediction depth: LlamaForCausalLM has no place for it."""
    from ptdp.checkpoint.save import save_full_state
    from ptdp.config import load_config
    from ptdp.hf.convert import to_hf
    from ptdp.inference.local_model import initial_state
    cfg = load_config(None, ["model.preset=llama", "model.num_layers=2", "model.hidden_size=32",
                             "model.num_heads=4", "model.seq_length=16", "model.vocab_size=128",
                             "model.mtp_layers=1", "data.source=synthetic"], world_size=1)
    save_full_state(initial_state(cfg.model, 0), cfg, tmp_path / "ptdp")
    assert to_hf(tmp_path / "ptdp", tmp_path / "hf")["class"] == "LlamaForCausalLM"
    assert capsys.readouterr().err.strip().splitlines() == [
        "the 1 multi-token-prediction depth(s) (model.mtp_layers) are not written: "
        "LlamaForCausalLM's checkpoints have no place for them; the model's logits are whole "
        "without them"]
    transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
