"""`train.compile`: torch.compile the transformer layers, never the whole model.

Compiling regions of consecutive layers (`train.compile_layers`, ptdp/config/compilation.py;
models/transformer.py `TransformerStack`) keeps everything around them eager and unchanged:
pipeline chunks and the executor, activation recomputation (torch.utils.checkpoint around
compiled regions) and the tensor-parallel collectives (graph breaks, see
ptdp/parallel/mappings.py). Every layer runs the same code on same-shaped inputs, so one
compiled graph serves all regions of a length (plus one more for evaluation, which runs
without autograd). The vocab-parallel loss takes its fused
form: its passes over the logits are compiled kernels of their own, its all-reduces eager
(ptdp/parallel/cross_entropy.py).

What changes with compile on: elementwise chains (LayerNorm, bias + GeLU, bias + dropout +
add) become fused kernels, so results differ from eager by float round-off, and dropout masks
come from inductor's generator (still seeded from torch's default generator, so recomputation
replays them). Start-up pays the compilation (seconds to a minute per distinct graph).
"""

from __future__ import annotations

import torch


def should_compile(setting: bool | None, device: torch.device) -> bool:
    """`train.compile`: true / false, or null = on when training on CUDA, off on CPU."""
    if setting is None:
        return torch.device(device).type == "cuda"
    return bool(setting)
