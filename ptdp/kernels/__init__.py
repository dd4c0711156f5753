"""Fused elementwise paths and per-layer compilation (dissertation ch. 4; torch-native).

* `fused.py`: bias + GeLU (exact or tanh), bias + SwiGLU or GeGLU and bias + dropout + residual add, as plain torch functions that
  torch.compile fuses; eager PyTorch runs them with exactly the unfused numerics.
* `compile.py`: whether to torch.compile the transformer layers (`train.compile`).
"""

from ptdp.kernels.compile import should_compile
from ptdp.kernels.fused import (ACTIVATIONS, GATES, bias_dropout_add, bias_geglu, bias_gelu,
                                bias_gelu_tanh, bias_swiglu)

__all__ = ["ACTIVATIONS", "GATES", "bias_dropout_add", "bias_geglu", "bias_gelu", "bias_gelu_tanh",
           "bias_swiglu", "should_compile"]
