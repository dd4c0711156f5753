"""The model shape of a megatron-core checkpoint that has no Megatron-LM `args` (written by
another trainer, e.g. Megatron-Bridge or NeMo 2, which keep the model config beside the
checkpoint): from a config file beside it, the `model.*` overrides of `ptdp convert`, and
what the weights show; refusing in one line only what none of them gives.

Read beside the iteration directory (or its parent): `run_config.yaml` (Megatron-Bridge) or
`context/model.yaml` (NeMo 2), YAML or JSON; the first mapping in it holding `num_layers` and
`hidden_size` is the model's megatron-core TransformerConfig (`num_moe_experts`,
`gated_linear_unit`, `share_embeddings_and_output_weights`, ... : TRANSFORMER_CONFIG below).

From the weights: the layers, hidden and vocabulary sizes (the word table), the MLP width,
SwiGLU (fc1 twice fc2's width), biases, LayerNorm or RMSNorm (a norm bias), learned or rotary
positions (a position table), a separate output layer, the experts and the multi-token-
prediction depths. What only a config says and changes the logits must be given: the attention
heads, the norm epsilon and, for rotary positions, the base and the sequence length.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import yaml

from ptdp.config import ModelConfig
from ptdp.config.models import GPT2_BLOCK, LLAMA_BLOCK
from ptdp.megatron.experts import expert_name
from ptdp.megatron.moe_args import moe_config
from ptdp.megatron.mtp_names import depth_count
from ptdp.megatron.errors import MegatronConversionError, argument, require

BESIDE = ("run_config.yaml", "context/model.yaml")
# megatron-core TransformerConfig / model provider fields -> ptdp's ModelConfig keys
TRANSFORMER_CONFIG = {
    "num_layers": "num_layers", "hidden_size": "hidden_size",
    "num_attention_heads": "num_heads", "num_query_groups": "num_kv_heads",
    "ffn_hidden_size": "ffn_hidden_size", "seq_length": "seq_length",
    "layernorm_epsilon": "layernorm_eps", "rotary_base": "rope_theta",
    "init_method_std": "init_std", "hidden_dropout": "dropout",
    "attention_dropout": "attention_dropout", "add_bias_linear": "bias",
    "add_qkv_bias": "qkv_bias", "mtp_num_layers": "mtp_layers",
    "mtp_loss_scaling_factor": "mtp_loss_scale",
}   # and the MoE fields (`num_moe_experts`, `moe_*`), read as Megatron-LM's arguments are
NEEDED = ("num_heads", "layernorm_eps")
NEEDED_FOR_ROPE = ("rope_theta", "seq_length")


def _first_model_mapping(data):
    if isinstance(data, dict):
        if "num_layers" in data and "hidden_size" in data:
            return data
        for value in data.values():
            if (found := _first_model_mapping(value)) is not None:
                return found
    return None


def beside_config(directory: Path) -> tuple[Path, dict] | None:
    """(file, ModelConfig keys) of a model config beside the checkpoint, if one is there."""
    for folder in (directory, directory.parent):
        for name in BESIDE:
            path = folder / name
            if not path.is_file():
                continue
            try:
                data = yaml.safe_load(path.read_text())   # JSON is YAML too
            except (OSError, yaml.YAMLError) as err:
                raise MegatronConversionError(f"{path}: cannot read it ({err})") from None
            found = _first_model_mapping(data)
            require(found is not None, f"{path} has no model config (a mapping with num_layers "
                                       f"and hidden_size)")
            return path, _ptdp_keys(found, path)
    return None


def _ptdp_keys(found: dict, path: Path) -> dict:
    out = {ours: found[theirs] for theirs, ours in TRANSFORMER_CONFIG.items()
           if found.get(theirs) is not None}
    if found.get("num_moe_experts"):   # the MoE fields are named as Megatron-LM's arguments
        moe = SimpleNamespace(**{**found, "num_experts": found["num_moe_experts"]})
        out.update(moe_config(moe, argument))
    if found.get("num_query_groups") is None and "num_heads" in out:
        out["num_kv_heads"] = out["num_heads"]
    if "normalization" in found:
        out["normalization"] = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}.get(
            found["normalization"], found["normalization"])
    if "position_embedding_type" in found:
        out["position_embedding"] = {"learned_absolute": "learned", "rope": "rope"}.get(
            found["position_embedding_type"], found["position_embedding_type"])
    if "share_embeddings_and_output_weights" in found:
        out["tie_embeddings"] = bool(found["share_embeddings_and_output_weights"])
    if found.get("gated_linear_unit"):
        activation = json.dumps(found.get("activation_func", "silu"))
        require("silu" in activation, f"{path}: a gated MLP with {activation}: ptdp's gated "
                                      f"MLP is SwiGLU")
        out["activation"] = "swiglu"
    for name, why in [("layernorm_zero_centered_gamma", "a zero-centred norm gain"),
                      ("qk_layernorm", "normalised queries and keys"),
                      ("multi_latent_attention", "latent attention (converted only from a "
                                                 "checkpoint with Megatron-LM's args)")]:
        require(not found.get(name), f"{path}: {name}: {why}, which ptdp's converter lacks")
    return out


_LAYER = re.compile(r"^(?:decoder|encoder)\.layers\.(\d+)\.")


def from_weights(state: dict) -> dict:
    """ModelConfig keys the weights of a full Megatron state show."""
    word = state.get("embedding.word_embeddings.weight")
    require(word is not None, "the checkpoint has no embedding.word_embeddings.weight")
    layers = {int(m.group(1)) for name in state if (m := _LAYER.match(name))}
    out = {"num_layers": 1 + max(layers, default=-1), "hidden_size": word.shape[1],
           "vocab_size": word.shape[0], "tie_embeddings": "output_layer.weight" not in state,
           "position_embedding": ("learned" if "embedding.position_embeddings.weight" in state
                                  else "rope"),
           "normalization": ("layernorm" if any(n.endswith("input_layernorm.bias") for n in state)
                             else "rmsnorm"),
           "bias": any(n.endswith("linear_proj.bias") for n in state)}
    if depths := depth_count(state):   # multi-token prediction (ptdp/megatron/mtp_names.py)
        out["mtp_layers"] = depths
    fc2 = next((v for n, v in state.items() if n.endswith(".mlp.linear_fc2.weight")), None)
    fc1 = next((v for n, v in state.items() if n.endswith(".mlp.linear_fc1.weight")), None)
    expert_fc1 = next((v for n, v in state.items() if expert_name(n)
                       and n.endswith("linear_fc1.weight")), None)
    expert_fc2 = next((v for n, v in state.items() if expert_name(n)
                       and n.endswith("linear_fc2.weight")), None)
    one_fc1, one_fc2 = (fc1, fc2) if fc2 is not None else (expert_fc1, expert_fc2)
    if one_fc2 is not None:
        out["activation"] = "swiglu" if one_fc1.shape[0] == 2 * one_fc2.shape[1] else "gelu"
    if fc2 is not None:
        out["ffn_hidden_size"] = fc2.shape[1]
    experts = {parts[1] for name in state if (parts := expert_name(name))}
    if experts:
        out.update(num_experts=1 + max(experts), moe_ffn_hidden_size=expert_fc2.shape[1])
        out.setdefault("ffn_hidden_size", expert_fc2.shape[1])
    return out


def _query_groups(state: dict, keys: dict) -> int:
    """The key/value head count of the QKV rows: head_dim x (heads + 2 x groups)."""
    qkv = next((v for n, v in state.items() if n.endswith("linear_qkv.weight")), None)
    heads = keys["num_heads"]
    if qkv is None:
        return heads
    return (qkv.shape[0] // (keys["hidden_size"] // heads) - heads) // 2


def model_config(arch: str, directory: Path, state: dict, overrides) -> ModelConfig:
    """The ModelConfig of an args-less checkpoint: the weights', then a config beside it, then
    the `model.*` overrides; one line naming what is still missing."""
    from ptdp.config import parse_overrides
    keys = dict(from_weights(state))
    found = beside_config(directory)
    if found is not None:
        keys.update(found[1])
    keys.update(parse_overrides([o for o in overrides if o.startswith("model.")]).get("model", {}))
    needed = NEEDED + (NEEDED_FOR_ROPE if keys.get("position_embedding") == "rope" else ())
    missing = [f"model.{k}" for k in needed if k not in keys]
    if missing:
        raise MegatronConversionError(
            f"the checkpoint has no 'args' (Megatron-LM's) and "
            f"{'nothing beside it' if found is None else found[0]} gives {', '.join(missing)}: "
            f"give {'them' if len(missing) > 1 else 'it'} as overrides (e.g. {missing[0]}=...)")
    keys.setdefault("seq_length", state["embedding.position_embeddings.weight"].shape[0]
                    if "embedding.position_embeddings.weight" in state else 0)
    keys.setdefault("num_kv_heads", _query_groups(state, keys))
    preset = LLAMA_BLOCK if keys["position_embedding"] == "rope" else GPT2_BLOCK
    try:
        return ModelConfig(arch=arch, preset=preset, **keys)
    except TypeError as err:
        raise MegatronConversionError(f"model config: {err}") from None
