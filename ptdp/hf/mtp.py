"""Multi-token prediction's depths (models/mtp.py) in DeepSeek-V3's checkpoint layout, beside
the weights transformers' class holds.

DeepSeek's release keeps depth j of D (config.json's `num_nextn_predict_layers`) as one more
decoder layer, `model.layers.{L + j}` (L = num_hidden_layers), which transformers' class does
not build. Its weights against ptdp's `mtp.{j}.*`:
  * `enorm`, `hnorm`, `eh_proj` ([h, 2h], the embedding's half first): the same names;
  * `shared_head.norm`: `final_ln`;
  * the decoder layer's own weights: `layer.*`, mapped by the family's code for its decoder
    layers as layer L + j (of the last decoder layer's kind, ptdp/config/schema.py
    `is_moe_layer`): DeepSeek's interleaved rotary rows, the experts, the router, whose
    `e_score_correction_bias` the checkpoint's "moe" metadata keeps under L + j;
  * `embed_tokens` and `shared_head.head`: copies of `model.embed_tokens` and `lm_head` in
    DeepSeek's release. ptdp's depths share the model's, so a copy that differs is refused on
    the way in; both copies are written on the way out, as released.
From Hugging Face the layers are read from the safetensors files themselves, experts per expert
(as released, and as save_pretrained writes them) or stacked (as transformers 5 holds them);
a tensor of those layers that ptdp has no place for is refused. config.json's D without those
layers in the files (a checkpoint saved by transformers) converts without multi-token
prediction, saying so on stderr: the model's logits are whole without them. To Hugging Face they
are added to save_pretrained's last weights file (and its index) and config.json gets D; a
family without this layout writes the model without its depths, saying so on stderr.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import torch

from ptdp.config import ModelConfig
from ptdp.hf.base import ConversionError, getter, require

INDEX = "model.safetensors.index.json"
_OWN = [("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
        ("final_ln", "shared_head.norm")]
# (DeepSeek's copy in depth j's layer, the model's weight it copies, what ptdp shares)
_COPIES = [("embed_tokens.weight", "model.embed_tokens.weight", "embedding"),
           ("shared_head.head.weight", "lm_head.weight", "output layer")]
_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def depth_prefixes(cfg: ModelConfig) -> tuple[str, ...]:
    """The HF names' prefix of each depth's layer, `model.layers.{L + j}.`."""
    return tuple(f"model.layers.{cfg.num_layers + j}." for j in range(cfg.mtp_layers))


class PredictionLayers:
    """A family whose checkpoints keep the depths as decoder layers after the model's (mixed in
    before its base family, whose `from_hf`/`to_hf` map the rest)."""

    count_key = "num_nextn_predict_layers"

    def from_hf(self, cfg: ModelConfig, hf: dict) -> dict:
        out = super().from_hf(cfg, hf)
        for j, theirs in enumerate(depth_prefixes(cfg)):
            used = self._depth_from_hf(cfg, j, hf, out)
            left = sorted(name for name in hf if name.startswith(theirs) and name not in used)
            require(not left, f"the Hugging Face weights hold {len(left)} tensor(s) of the "
                              f"prediction layer {theirs}* that ptdp has no place for, the "
                              f"first '{left[0] if left else ''}'")
        return out

    def to_hf(self, cfg: ModelConfig, full: dict) -> dict:
        out = super().to_hf(cfg, full)
        for j, theirs in enumerate(depth_prefixes(cfg)):
            ours, layer = f"mtp.{j}.", cfg.num_layers + j
            for mine, hf_name in _OWN:
                out[f"{theirs}{hf_name}.weight"] = full[f"{ours}{mine}.weight"]
            for mine, hf_name in self._layer_pairs(cfg, layer):
                out[theirs + hf_name] = full[f"{ours}layer.{mine}"]
            self.attention_to_hf(cfg, full, f"{ours}layer.attention.", f"{theirs}self_attn.",
                                 out)
            self.mlp_to_hf(cfg, layer, full, f"{ours}layer.mlp.", f"{theirs}mlp.", out)
            for copy, original, _ in _COPIES:
                out[theirs + copy] = out[original]
        return out

    def _depth_from_hf(self, cfg: ModelConfig, j: int, hf: dict, out: dict) -> set[str]:
        """Depth j's weights from `hf` into `out`; returns the HF names it read."""
        ours, theirs, layer = f"mtp.{j}.", depth_prefixes(cfg)[j], cfg.num_layers + j
        used, plain = set(), getter(hf)

        def get(name: str) -> torch.Tensor:
            used.add(name)
            return plain(name)
        for mine, hf_name in _OWN:
            out[f"{ours}{mine}.weight"] = get(f"{theirs}{hf_name}.weight").contiguous()
        for mine, hf_name in self._layer_pairs(cfg, layer):
            out[f"{ours}layer.{mine}"] = get(theirs + hf_name).contiguous()
        self.attention_from_hf(cfg, get, f"{ours}layer.attention.", f"{theirs}self_attn.", out)
        self.mlp_from_hf(cfg, layer, get, f"{ours}layer.mlp.", f"{theirs}mlp.", out)
        for copy, original, what in _COPIES:
            require(torch.equal(get(theirs + copy), plain(original)),
                    f"'{theirs}{copy}' differs from '{original}': ptdp's prediction depths "
                    f"share the model's {what}")
        if cfg.is_moe_layer(layer):   # its router's bias: the metadata's (meta_from_hf)
            get(f"{theirs}mlp.gate.e_score_correction_bias")
        return used

    def _layer_pairs(self, cfg: ModelConfig, layer: int):
        """(ptdp name, HF name) of decoder layer `layer`'s weights that only change name, after
        `layers.{layer}.` / `model.layers.{layer}.`: as the family's `_pairs` names them in a
        model one layer deeper than `layer`."""
        deeper = dataclasses.replace(cfg, num_layers=layer + 1, mtp_layers=0)
        ours, theirs = f"layers.{layer}.", f"model.layers.{layer}."
        return [(mine[len(ours):], hf_name[len(theirs):])
                for mine, hf_name, _ in self._pairs(deeper) if mine.startswith(ours)]


def prediction_depths(hf_dir, family, config, num_layers: int) -> int:
    """model.mtp_layers of an HF directory: config.json's D when its safetensors hold the D
    layers, 0 when they hold none of them (saying so on stderr) or the family has no such
    layers; some of them only is refused."""
    if not isinstance(family, PredictionLayers):
        return 0
    want = int(getattr(config, family.count_key, 0) or 0)
    if not want:
        return 0
    names = _weight_files(Path(hf_dir))
    prefixes = [f"model.layers.{num_layers + j}." for j in range(want)]
    held = [p for p in prefixes if any(name.startswith(p) for name in names)]
    if not held:
        print(f"{hf_dir}: config.json has {family.count_key}={want}, but the safetensors hold "
              f"no '{prefixes[0]}*': converted without multi-token prediction "
              f"(model.mtp_layers=0)", file=sys.stderr)
        return 0
    require(held == prefixes, f"config.json has {family.count_key}={want}, but the safetensors "
                              f"hold {len(held)} of those layers ({', '.join(held)})")
    return want


def read_depths(hf_dir, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The depths' tensors from the safetensors, under HF's names, experts stacked as
    transformers 5 holds them (`mlp.experts.gate_up_proj`: gate rows then up rows; `down_proj`)."""
    from safetensors import safe_open
    prefixes = depth_prefixes(cfg)
    if not prefixes:
        return {}
    files: dict[Path, list[str]] = {}
    for name, path in _weight_files(Path(hf_dir)).items():
        if name.startswith(prefixes):
            files.setdefault(path, []).append(name)
    out = {}
    for path, names in files.items():
        with safe_open(str(path), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in names})
    return _stacked(out, cfg.num_experts)


def split_depths(family, cfg: ModelConfig, weights: dict) -> dict[str, torch.Tensor]:
    """Take the depths' tensors out of `weights` (HF's, from family.to_hf) for `write_depths`,
    experts per expert as released; a family without the layout writes none (said on stderr)."""
    if not cfg.mtp_layers:
        return {}
    if not isinstance(family, PredictionLayers):
        print(f"the {cfg.mtp_layers} multi-token-prediction depth(s) (model.mtp_layers) are not "
              f"written: {family.hf_class}'s checkpoints have no place for them; the model's "
              f"logits are whole without them", file=sys.stderr)
        return {}
    prefixes = depth_prefixes(cfg)
    return _per_expert({name: weights.pop(name) for name in list(weights)
                        if name.startswith(prefixes)})


def write_depths(out_dir, tensors: dict[str, torch.Tensor]) -> None:
    """Add `tensors` to save_pretrained's weights in out_dir: to its last file, and to its index
    when it wrote one (a sharded model)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    if not tensors:
        return
    out_dir = Path(out_dir)
    index = json.loads((out_dir / INDEX).read_text()) if (out_dir / INDEX).is_file() else None
    last = sorted(set(index["weight_map"].values()))[-1] if index else "model.safetensors"
    with safe_open(str(out_dir / last), framework="pt") as f:
        metadata = f.metadata()
    added = {name: value.detach().clone().contiguous() for name, value in tensors.items()}
    save_file({**load_file(str(out_dir / last)), **added}, str(out_dir / last), metadata)
    if index:
        index["weight_map"].update(dict.fromkeys(added, last))
        index.setdefault("metadata", {})["total_size"] = index["metadata"].get("total_size", 0) \
            + sum(t.numel() * t.element_size() for t in added.values())
        (out_dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _weight_files(hf_dir: Path) -> dict[str, Path]:
    """{tensor name: its safetensors file} by the index, else by each file's header."""
    from safetensors import safe_open
    if (hf_dir / INDEX).is_file():
        weight_map = json.loads((hf_dir / INDEX).read_text()).get("weight_map", {})
        return {name: hf_dir / file for name, file in weight_map.items()}
    out = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), path))
    return out


def _stacked(tensors: dict, num_experts: int) -> dict:
    """Experts per expert (`experts.{e}.gate_proj/up_proj/down_proj.weight`) -> stacked; those
    past num_experts stay as they are (no place for them)."""
    out, experts = {}, {}
    for name, value in tensors.items():
        match = _EXPERT.match(name)
        if match and int(match[2]) < num_experts:
            experts.setdefault(match[1], {})[(int(match[2]), match[3])] = value
        else:
            out[name] = value
    for prefix, parts in experts.items():
        def part(e: int, kind: str, prefix=prefix, parts=parts) -> torch.Tensor:
            if (e, kind) not in parts:
                raise ConversionError(f"the Hugging Face weights have no "
                                      f"'{prefix}{e}.{kind}.weight'")
            return parts[e, kind]
        every = range(num_experts)
        out[f"{prefix}gate_up_proj"] = torch.stack(
            [torch.cat([part(e, "gate_proj"), part(e, "up_proj")]) for e in every])
        out[f"{prefix}down_proj"] = torch.stack([part(e, "down_proj") for e in every])
    return out


def _per_expert(tensors: dict) -> dict:
    """The inverse of `_stacked`."""
    out = {}
    for name, value in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            for e, rows in enumerate(value):
                gate, up = rows.chunk(2)
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            for e, rows in enumerate(value):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = rows
        else:
            out[name] = value
    return out
