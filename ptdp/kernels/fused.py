"""The elementwise chains that follow a transformer layer's GEMMs (dissertation ch. 4).

Megatron-LM fuses bias + GeLU (after the first MLP GEMM) and bias + dropout + residual add
(after the attention projection and the second MLP GEMM) with TorchScript. Here they are plain
torch functions, and the parallel linears hand their bias over instead of adding it
(`skip_bias_add` in ptdp/parallel/layers.py), so the whole chain is visible in one place:

* eager PyTorch runs each op as its own kernel, with the same numerics and the same dropout
  draws (default generator, same shape, same order) as the unfused layer; the bias is added
  in place into `x`, the GEMM's fresh output that nothing else holds (the GEMM's backward
  needs only its inputs), which saves allocating and writing one more activation-sized
  tensor per chain;
* with `train.compile` the transformer layer is compiled (ptdp/kernels/compile.py) and
  inductor fuses each chain into one kernel, recomputing the GeLU input in backward instead
  of storing it. TorchScript is not used: torch.compile supersedes it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """GeLU(x + bias): the exact (erf) GeLU, or with approximate='tanh' the tanh approximation
    (GPT-2's `gelu_new`, Megatron-LM's fused bias-GeLU). Overwrites `x`."""
    return F.gelu(x if bias is None else x.add_(bias), approximate=approximate)


def bias_gelu_tanh(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """GeLU(x + bias) with the tanh approximation (model.activation=gelu_tanh). Overwrites `x`."""
    return bias_gelu(x, bias, approximate="tanh")


# A gated activation's gate function (models/moe.py uses it on gate and up held apart)
GATES = {"swiglu": F.silu, "geglu": functools.partial(F.gelu, approximate="tanh")}


def _bias_gated(x: torch.Tensor, bias: torch.Tensor | None, gate) -> torch.Tensor:
    """gate(g) * up of x + bias, whose last dimension alternates gate and up columns
    (models/transformer.py ParallelMLP): [..., 2f] -> [..., f]. Overwrites `x`."""
    x = x if bias is None else x.add_(bias)
    # unbind, not two selects: its backward stacks both gradients into one tensor, where each
    # select's would zero-fill a full-width gradient for autograd to sum (bit-identical, faster)
    g, up = x.unflatten(-1, (-1, 2)).unbind(-1)
    return gate(g) * up


def bias_swiglu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """SiLU(gate) * up (Llama's MLP). Overwrites `x`."""
    return _bias_gated(x, bias, GATES["swiglu"])


def bias_geglu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """GeLU(gate) * up with the tanh GeLU (Gemma's MLP). Overwrites `x`."""
    return _bias_gated(x, bias, GATES["geglu"])


# model.activation -> the fused chain after fc1 (models/transformer.py, models/moe.py); the
# names are the model catalogue's (ptdp/config/models.py ACTIVATIONS, GATED_ACTIVATIONS)
ACTIVATIONS = {"gelu": bias_gelu, "gelu_tanh": bias_gelu_tanh, "swiglu": bias_swiglu,
               "geglu": bias_geglu}


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                     p: float, training: bool) -> torch.Tensor:
    """residual + Dropout(x + bias). The dropout mask comes from the default generator: the
    hidden state is replicated across tensor ranks, so every rank draws the same mask.
    Overwrites `x`."""
    if bias is not None:
        x = x.add_(bias)
    if p > 0 and training:
        x = F.dropout(x, p, training=True)
    return residual + x
