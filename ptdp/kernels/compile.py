"""`train.compile`: torch.compile each transformer layer, never the whole model.

Compiling per layer keeps everything around the layers eager and unchanged: pipeline chunks
and the executor, activation recomputation (torch.utils.checkpoint around compiled layers),
the tensor-parallel collectives (graph breaks, see ptdp/parallel/mappings.py) and the
vocab-parallel loss. Every layer runs the same code on same-shaped inputs, so one compiled
graph serves all layers (plus one more for evaluation, which runs without autograd).

What changes with compile on: elementwise chains (LayerNorm, bias + GeLU, bias + dropout +
add) become fused kernels, so results differ from eager by float round-off, and dropout masks
come from inductor's generator (still seeded from torch's default generator, so recomputation
replays them). Start-up pays the compilation (seconds to a minute per distinct graph).

Code that must stay out of compiled graphs (collectives, dropout masks drawn from the default
generator, deferred weight gradients) is marked `@eager`: `torch.compiler.disable`, applied
when the first module is compiled. Applying it at import time would import torch._dynamo, a
second of start-up in every process, and most processes never compile.
"""

from __future__ import annotations

import functools

import torch

_EAGER_REGIONS: list[dict] = []   # {"fn": the function, "run": what a call runs}


def eager(fn):
    """Keep `fn` out of compiled graphs: a compiled caller breaks its graph and runs it
    eagerly, as with `torch.compiler.disable` (which `compile_in_place` applies)."""
    region = {"fn": fn, "run": fn}
    _EAGER_REGIONS.append(region)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return region["run"](*args, **kwargs)
    return call


def compile_in_place(module: torch.nn.Module) -> None:
    """`module.compile()` (parameter names and state_dict keys stay the same), with every
    `@eager` region a graph break."""
    for region in _EAGER_REGIONS:
        if region["run"] is region["fn"]:
            region["run"] = torch.compiler.disable(region["fn"])
    module.compile()


def should_compile(setting: bool | None, device: torch.device) -> bool:
    """`train.compile`: true / false, or null = on when training on CUDA, off on CPU."""
    if setting is None:
        return torch.device(device).type == "cuda"
    return bool(setting)
