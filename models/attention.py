"""Core attention: which kernel computes softmax(Q K^T / sqrt(d) + mask) V, and the masks it
takes, built once per micro-batch.

What limits the keys a query sees, beyond causality, is an `AttentionMask`, built by the chunk
before its layers run (`attention_mask`): the documents packed into each sample
(`data.reset_attention_mask`: no token attends across an <eod>), BERT's padding, and the
layers' sliding windows (`model.sliding_window`, `model.sliding_window_layers`). The window
follows Hugging Face's `sliding_window_causal` mask (transformers' masking_utils.py): key j is
visible to query i iff j <= i and i - j < window, so a query sees itself and the window - 1
tokens before it (sequence indices, not positions reset per document). A window >= the
sequence length is no window. That rule (causal, same document, within the window) is one
function, `visible` (ptdp/parallel/ring_attention.py, below this package so the ring's blocks
use it too); every mask here is built from it.

The mask is prepared once per micro-batch for every window the chunk's layers use, in the form
the kernel takes (`AttentionMask.prepared[window]`):

* None: nothing beyond causality; SDPA with `is_causal` (flash on CUDA; grouped-query heads
  through `enable_gqa`, which flash supports).
* a FlexAttention `BlockMask` (CUDA, causal, no attention dropout): documents and windows as a
  block-sparse mask (blocks wholly outside a document or window are skipped, no s x s tensor);
  grouped-query heads natively. FlexAttention has no backward on CPU (torch 2.13), so the CPU
  never takes this path.
* a boolean keep-mask [b, 1, s, s] ([b, 1, 1, s] for padding): SDPA with `attn_mask`. On CPU
  that is today's path (the fused CPU kernel, bit for bit what it was); on CUDA with a mask
  (padding, or dropout with documents/windows) the memory-efficient kernel, which takes a mask
  but not `enable_gqa`: K/V are expanded to the query heads first (`expand_kv`).

With context parallelism the ring (ptdp/parallel/ring_attention.py) takes the documents (the
whole sequence's ids, which every context rank holds) and the window itself, block by block.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ptdp.models.recompute import checkpointed
from ptdp.parallel.context import ContextParallel
from ptdp.parallel.ring_attention import expand_heads, ring_attention, visible
from ptdp.parallel.rng import TensorParallelRNG


@dataclass
class AttentionMask:
    """One micro-batch's attention limits; `prepared` maps each window (None = no window) the
    chunk's layers use to what the kernel takes (see the module's docstring)."""

    causal: bool
    documents: torch.Tensor | None = None    # [b, s] document of each token, whole sequence
    padding: torch.Tensor | None = None      # [b, s] 1 = a real token (bidirectional encoders)
    prepared: dict = field(default_factory=dict)


def effective_window(window: int | None, seq_length: int) -> int | None:
    """None where a window hides nothing: no window, or one at least the sequence long."""
    return None if window is None or window >= seq_length else window


def attention_mask(causal: bool, seq: int, device, *, documents=None, padding=None,
                   windows=(None,), dropout: float = 0.0,
                   cp: ContextParallel | None = None) -> AttentionMask | None:
    """The micro-batch's mask for sequences of `seq` tokens, prepared for `windows` (the
    chunk's layers' windows); None when nothing limits attention beyond causality (the
    default, fastest path)."""
    windows = tuple(effective_window(w, seq) for w in windows)
    if documents is None and padding is None and all(w is None for w in windows):
        return None
    mask = AttentionMask(causal, documents, padding)
    if cp is not None and cp.size > 1:   # the ring builds each block's mask itself
        return mask
    for window in windows:
        if window not in mask.prepared:
            mask.prepared[window] = _prepare(mask, window, seq, device, dropout)
    return mask


def _prepare(mask: AttentionMask, window: int | None, seq: int, device, dropout: float):
    if mask.padding is not None:   # [b, s] -> broadcast over heads and queries
        return mask.padding.bool()[:, None, None, :]
    if mask.documents is None and window is None:
        return None
    if torch.device(device).type == "cuda" and mask.causal and dropout == 0.0:
        return flex_block_mask(mask.documents, window, seq, device)
    if mask.documents is None:
        return window_mask(seq, window, device)[:, None]
    return keep_mask(mask.documents, window, causal=mask.causal)[:, None]


def keep_mask(documents: torch.Tensor, window: int | None = None, causal: bool = True,
              ) -> torch.Tensor:
    """[b, s] document ids -> [b, s, s] boolean keep-mask (query, key) of `visible`: the keys
    at or before the query (when causal) in its own document, and within `window` of it."""
    i = torch.arange(documents.shape[1], device=documents.device)
    return visible(i[:, None], i[None, :], causal, window,
                   documents[:, :, None], documents[:, None, :])


def window_mask(seq: int, window: int, device=None) -> torch.Tensor:
    """[1, s, s] keep-mask of a causal sliding window alone (one document)."""
    return keep_mask(torch.zeros(1, seq, dtype=torch.long, device=device), window)


def document_mask(document_ids: torch.Tensor | None) -> torch.Tensor | None:
    """data.reset_attention_mask: [b, s] document of each token -> [b, s, s] keep-mask where a
    query sees the keys at or before it in its own document (Megatron's reset attention mask:
    no token attends across an <eod>; the <eod> ends, and belongs to, its document)."""
    return None if document_ids is None else keep_mask(document_ids)


def decoding_mask(start: int, new: int, window: int | None, device=None):
    """Keep-mask [new, start + new] of `new` queries after `start` cached positions (generation,
    ptdp/inference/generate.py), or None where causality alone says it (from position 0 with
    is_causal, or one query that sees every key)."""
    total = start + new
    window = effective_window(window, total)
    if window is None and (start == 0 or new == 1):
        return None
    i = torch.arange(start, total, device=device)[:, None]
    return visible(i, torch.arange(total, device=device)[None], True, window)


def mask_mod(documents: torch.Tensor | None, window: int | None):
    """FlexAttention's mask_mod: keep (b, h, q, k) iff `visible` (causal, same document,
    within the window)."""
    def keep(b, h, q, k):
        docs = () if documents is None else (documents[b, q], documents[b, k])
        return visible(q, k, True, window, *docs)
    return keep


def flex_block_mask(documents: torch.Tensor | None, window: int | None, seq: int, device):
    """The block-sparse FlexAttention mask of `mask_mod`, shared by every head and every layer
    of the micro-batch (on CUDA built by a compiled kernel: no s x s tensor)."""
    from torch.nn.attention.flex_attention import create_block_mask
    device = torch.device(device)
    batch = None if documents is None else documents.shape[0]   # None: the same for all
    return create_block_mask(mask_mod(documents, window), B=batch, H=None, Q_LEN=seq,
                             KV_LEN=seq, device=device, _compile=device.type == "cuda")


@functools.cache
def _compiled_flex():
    """flex_attention compiled once: eager FlexAttention is a slow reference path."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _flex_attention(q, k, v, block_mask, scale=None):
    from torch.nn.attention.flex_attention import flex_attention
    # inside a compiled layer (train.compile) dynamo compiles it with the layer
    flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
    return flex(q, k, v, block_mask=block_mask, scale=scale,
                enable_gqa=k.shape[1] != q.shape[1])


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, groups, s, d] -> [b, heads, s, d]: each K/V head repeated for its query heads (the
    order `enable_gqa` uses: query head i reads K/V head i // (heads / groups))."""
    return expand_heads(x, heads // x.shape[1])


def attention(q, k, v, mask=None, causal: bool = False, dropout: float = 0.0,
              expand: bool | None = None, scale: float | None = None):
    """q [b, heads, s, d], k and v [b, groups, s, d] -> [b, heads, s, d]. `mask`: a prepared
    form (None, a BlockMask or a boolean keep-mask). `expand`: expand grouped K/V to the
    query heads when a mask is given (default: on CUDA, where the kernels that take a mask
    do not take `enable_gqa`). `scale`: the softmax scale (None: 1/sqrt(d))."""
    if mask is not None and not isinstance(mask, torch.Tensor):   # a FlexAttention BlockMask
        return _flex_attention(q, k, v, mask, scale)
    expand = q.device.type == "cuda" if expand is None else expand
    if mask is not None and expand:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                          is_causal=causal and mask is None, scale=scale,
                                          **gqa)


@torch.compiler.disable
def attention_with_dropout(rng: TensorParallelRNG, q, k, v, mask, dropout: float,
                           causal: bool, scale: float | None = None):
    """Attention dropout draws from the tensor-parallel stream; swapping generator states is
    Python-side work a compiled layer must not trace, so this runs eagerly (a graph break)."""
    with rng.fork():
        return attention(q, k, v, mask, causal, dropout, scale=scale)


def core_attention(q, k, v, mask: AttentionMask | None, *, causal: bool, window: int | None,
                   dropout: float, rng: TensorParallelRNG, cp: ContextParallel,
                   tensor_ranks: int, scale: float | None = None):
    """A layer's attention over its heads: the ring with context parallelism (config: no
    padding, no dropout there), else the kernel of the mask prepared for this layer's window.
    `scale`: the softmax scale (None: 1/sqrt(d); DeepSeek's YaRN changes it).

    Attention dropout draws from the tensor-parallel stream, eagerly (a graph break in a
    compiled layer), except in a compiled layer with one tensor rank: there no other rank's
    heads need other masks, and the graph draws them from torch's generator, as it does the
    hidden dropout's (which torch.utils.checkpoint restores for recomputation)."""
    if cp.size > 1:
        documents = None if mask is None else mask.documents
        return ring_attention(q, k, v, cp, causal, scale, documents=documents, window=window)
    prepared = None if mask is None else mask.prepared[effective_window(window, q.shape[2])]
    if dropout == 0.0:  # no randomness: skip swapping RNG states
        return attention(q, k, v, prepared, causal, scale=scale)
    if tensor_ranks == 1 and torch.compiler.is_compiling():
        return attention(q, k, v, prepared, causal, dropout, scale=scale)
    return attention_with_dropout(rng, q, k, v, prepared, dropout, causal, scale)


class HeadAttention(nn.Module):
    """What an attention block (models/transformer.py ParallelAttention, models/
    latent_attention.py LatentAttention) does after projecting its heads: core attention with
    the micro-batch's mask and the block's window, recomputed in backward with the core_attn
    module of recompute=selective, then the output projection. A block sets `ctx`, `causal`,
    `window`, `proj` and `project(x, positions, norm) -> q, k, v`, and `softmax_scale` where
    it is not 1/sqrt(d)."""

    softmax_scale: float | None = None

    def default_positions(self, s: int, device) -> torch.Tensor:
        """The positions of this rank's s tokens: 0 .. s-1, or with context parallelism its two
        chunks' positions in the whole sequence."""
        cp = self.ctx.cp
        return cp.positions(s, device) if cp.size > 1 else torch.arange(s, device=device)

    def core_attention(self, q, k, v, mask):
        """q, k [b, heads, s, d], v [b, heads or groups, s, d_v] -> [b, heads, s, d_v]; dropout
        here is inside the tensor region. `mask`: the micro-batch's AttentionMask or None."""
        dropout = self.ctx.model.attention_dropout_rate if self.training else 0.0
        return core_attention(q, k, v, mask, causal=self.causal, window=self.window,
                              dropout=dropout, rng=self.ctx.rng, cp=self.ctx.cp,
                              tensor_ranks=self.ctx.tp.size, scale=self.softmax_scale)

    def forward(self, x, mask=None, positions=None, norm=None):
        """-> (output without the projection's bias, that bias); `norm`: the pre-norm, applied
        to x in `project` so that the layernorm module can rebuild its output."""
        q, k, v = self.project(x, positions, norm)
        if self.ctx.recomputes("core_attn"):
            out = checkpointed(self.ctx.rng, lambda *qkv: self.core_attention(*qkv, mask), q, k, v)
        else:
            out = self.core_attention(q, k, v, mask)
        out = out.permute(2, 0, 1, 3)  # [s, b, heads, d_v]
        return self.proj(out.reshape(out.shape[0], out.shape[1], -1))
