"""GPT and BERT built only from ptdp.parallel layers."""

from ptdp.config.models import BERT, FAMILY_NAMES, GPT
from ptdp.config.stages import layer_ranges
from ptdp.models.bert import BertChunk
from ptdp.models.gpt import GPTChunk
from ptdp.models.transformer import ModelContext

__all__ = ["BertChunk", "GPTChunk", "ModelContext", "build_chunk", "global_parameter_name",
           "named_global_parameters"]


# The model catalogue's families (ptdp/config/models.py) bound to their chunks.
_CHUNKS = {GPT.name: GPTChunk, BERT.name: BertChunk}
assert tuple(_CHUNKS) == FAMILY_NAMES, "every family of the catalogue has a chunk, and only those"


def build_chunk(ctx: ModelContext, stage: int, num_stages: int, stage_layers=None):
    """Virtual pipeline stage `stage` of `num_stages` for ctx.model.arch, holding its layers of
    `layer_ranges` (ptdp/config/stages.py): `stage_layers` (parallel.stage_layers) or even."""
    layers = layer_ranges(ctx.model.num_layers, num_stages, stage_layers)[stage]
    return _CHUNKS[ctx.model.arch](ctx, stage, num_stages, layers)


def global_parameter_name(chunk, local_name: str) -> str:
    """A chunk-local parameter name -> its name in the whole (single-process) model.

    `stack.layers.{i}.` becomes `layers.{first + i}.`; the last stage's copy of the tied word
    table is `embedding.word.weight`, like the original on the first stage; a
    multi-token-prediction depth's layer (models/mtp.py) `mtp.{k}.layer.`.
    """
    if local_name.startswith("stack.layers."):
        index, rest = local_name[len("stack.layers."):].split(".", 1)
        return f"layers.{chunk.stack.first + int(index)}.{rest}"
    if local_name.startswith("mtp.") and ".stack.layers.0." in local_name:
        return local_name.replace(".stack.layers.0.", ".layer.", 1)
    if local_name == "output.weight":
        return "embedding.word.weight"
    return local_name


def named_global_parameters(chunk):
    for name, param in chunk.named_parameters():
        yield global_parameter_name(chunk, name), param
