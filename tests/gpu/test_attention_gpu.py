"""The GPU tier's attention kernels (models/attention.py, ptdp/parallel/ring_attention.py): the
CUDA paths the CPU suite checks only by their masks and schemas (tests/test_attention.py).

* ring-attention blocks on CUDA's fused kernels (flash for bf16 without a mask, the
  memory-efficient kernel with a mask or in fp32), merged by their log-sum-exp: a ring of one
  rank runs every block of both chunks; against SDPA with the dense mask in fp32;
* FlexAttention with the block mask of packed documents and a sliding window (forward and
  backward) against the same;
* grouped-query attention with a mask on the memory-efficient kernel (K/V expanded), which
  SDPA refuses to run with `enable_gqa` there.

Written without a GPU at hand: a failure is as likely to be the test's as the code's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

DOCS = [[0] * 40 + [1] * 50 + [2] * 38, [0] * 100 + [1] * 28]


def _inputs(dtype, heads=4, groups=2, s=128, d=64):
    torch.manual_seed(0)
    make = lambda h: torch.randn(2, h, s, d, device="cuda", dtype=dtype,  # noqa: E731
                                 requires_grad=True)
    return make(heads), make(groups), make(groups)


def _reference(q, k, v, keep, dout):
    """fp32 SDPA (math kernel) with the dense keep-mask: output and gradients."""
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None], enable_gqa=True)
    return (out, *torch.autograd.grad(out, (q, k, v), dout.float()))


def _close(got, want, dtype):
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for a, b in zip(got, want):
        assert (a.float() - b).abs().max() <= tol * b.abs().max().clamp(min=1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("documents, window", [(False, None), (True, None), (False, 9),
                                               (True, 9)])
def test_ring_blocks_on_cuda_kernels(dtype, documents, window):
    from ptdp.models.attention import keep_mask
    from ptdp.parallel.context import ContextParallel
    from ptdp.parallel.ring_attention import ring_attention
    docs = torch.tensor(DOCS, device="cuda")
    q, k, v = _inputs(dtype)
    keep = keep_mask(docs if documents else torch.zeros_like(docs), window)
    out = ring_attention(q, k, v, ContextParallel(), True,
                         documents=docs if documents else None, window=window)
    dout = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    _close(got, _reference(q, k, v, keep, dout), dtype)


@pytest.mark.parametrize("window", [None, 9])
def test_flex_attention_with_documents_and_windows(window):
    from ptdp.models.attention import attention, attention_mask, keep_mask
    docs = torch.tensor(DOCS, device="cuda")
    q, k, v = _inputs(torch.bfloat16)
    mask = attention_mask(True, 128, "cuda", documents=docs, windows=(window,))
    prepared = mask.prepared[window]
    assert not isinstance(prepared, torch.Tensor)   # a BlockMask, not a dense mask
    out = attention(q, k, v, prepared, causal=True)
    dout = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    _close(got, _reference(q, k, v, keep_mask(docs, window), dout), torch.bfloat16)


def test_grouped_query_attention_with_a_mask_runs_the_efficient_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ptdp.models.attention import attention
    q, k, v = _inputs(torch.bfloat16)
    padding = torch.ones(2, 128, dtype=torch.bool, device="cuda")
    padding[1, 100:] = False
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):   # no fallback to the math kernel
        out = attention(q, k, v, padding[:, None, None, :])
        out.sum().backward()
    assert out.shape == q.shape and torch.isfinite(q.grad).all()
