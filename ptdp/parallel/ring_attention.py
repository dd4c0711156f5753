"""Ring attention over the context group (context parallelism, ptdp/parallel/context.py).

Each context rank holds the queries, keys and values of its two chunks (i and 2c-1-i of 2c).
Forward, in c steps: at step k the rank holds the K/V of context rank i-k; it attends its
queries to them block by block and passes them on to rank i+1 while it computes (the transfer
overlaps the block computation), receiving rank i-k-1's from rank i-1. Per (query chunk, key
chunk) pair the causal mask is whole (key chunk earlier), the diagonal's lower triangle (the
same chunk) or empty (key chunk later: the block is skipped). Each block returns its output
and log-sum-exp; the partial outputs merge exactly as softmax does,

    lse = logaddexp(lse_1, lse_2),  out = out_1 exp(lse_1 - lse) + out_2 exp(lse_2 - lse),

so after the last step every query row has attended to every key of the whole sequence.

Backward (a custom autograd Function, so only the local Q, K, V, the output and its
log-sum-exp are kept, never the other ranks' blocks): the K/V blocks travel around the ring
again, and with each one the accumulated dK/dV of its owner: at step k the rank adds its
block's contribution to the dK/dV that came from rank i-1 and passes them on with the K/V; a
last exchange brings every rank its own dK/dV, summed over every query of the sequence. Each
block's gradients use the *global* output and log-sum-exp (flash attention's backward), so the
sum of the blocks is the whole attention's gradient.

Packed documents (`data.reset_attention_mask`) and sliding windows make some blocks masked:
every context rank holds the whole sequence's document ids, so a block's keep-mask is built
from the document ids and the global positions of its (query chunk, key chunk) pair
(`block_keep`, by `visible`: the one rule every attention mask of the project follows, here
because models/attention.py sits above this package); with a window, blocks wholly outside it
are skipped and blocks wholly inside it need no mask (`visible_blocks`, the same rule decided
per block from the chunks' nearest and furthest (query, key) pairs). A query row with no visible key in a block has log-sum-exp -inf and weight 0
in the merge (`_merge` keeps such rows at 0 until a block gives them keys).

Inside a rank, each block runs a fused kernel that returns the log-sum-exp, chosen by device
(`block_forward` / `block_backward`, the same merge around every kernel):
`_scaled_dot_product_flash_attention_for_cpu` on CPU (a keep-mask as an additive bias); on
CUDA `_scaled_dot_product_flash_attention` (fp16/bf16, no mask) or else
`_scaled_dot_product_efficient_attention` (fp32, or a mask as an additive bias) and their
backward ops, as torch's own context parallelism (torch.distributed.tensor.experimental) calls
them; a plain matmul/softmax reference elsewhere (and on CPU with `FUSED_CPU = False`, which
tests select). Grouped-query attention sends
the smaller K/V (num_kv_heads) and expands them to the query heads per block only.
"""

from __future__ import annotations

import torch

from ptdp.parallel.context import GRAD_KV, KV, ContextParallel, chunk_ids

FULL, DIAGONAL, MASKED = "full", "diagonal", "masked"
FUSED_CPU = True   # CPU blocks through torch's flash kernel (tests switch to the math path)


def visible(q, k, causal: bool = True, window: int | None = None, q_document=None,
            k_document=None) -> torch.Tensor:
    """The rule of every attention mask (models/attention.py's masks, FlexAttention's mask_mod,
    generation's, the ring's blocks): key position `k` is visible to query position `q` iff
    it is not after it (when causal), within the `window` (q - k < window: the query and the
    window - 1 positions before it, Hugging Face's `sliding_window_causal`) and in the same
    document (when documents are given). Index tensors broadcast against each other."""
    keep = k <= q if causal else torch.ones_like(q - k, dtype=torch.bool)
    if window is not None:
        keep = keep & (q - k < window)
    if q_document is not None:
        keep = keep & (q_document == k_document)
    return keep


def visible_blocks(q_chunks: tuple, k_chunks: tuple, causal: bool, window: int | None = None,
                   length: int = 0, documents: bool = False) -> list[tuple[int, int, str]]:
    """(query slot, key slot, kind) of every block with something to attend to under `visible`:
    FULL (every key), DIAGONAL (the lower triangle) or MASKED (`block_keep` says which).
    Chunks are `length` tokens long (needed with a `window`); `documents`: a document mask
    applies, so every block is MASKED (which keys a document hides is data, not known here)."""
    out = []
    for a, qc in enumerate(q_chunks):
        for j, kc in enumerate(k_chunks):
            if causal and kc > qc:
                continue
            kind = FULL if not causal or kc < qc else DIAGONAL
            if window is not None:
                nearest = max(0, (qc - kc - 1) * length + 1)   # the smallest q - k (or 0)
                farthest = (qc - kc + 1) * length - 1          # the largest q - k
                if nearest >= window:
                    continue   # every key is outside the window
                if farthest >= window:
                    kind = MASKED
            out.append((a, j, MASKED if documents else kind))
    return out


def block_keep(q_chunk: int, k_chunk: int, length: int, causal: bool, window: int | None,
               documents: torch.Tensor | None, device) -> torch.Tensor:
    """The keep-mask [b or 1, 1, L, L] of one MASKED block: `visible` at the global positions
    of its chunks, with the whole sequence's document ids."""
    q_pos = torch.arange(q_chunk * length, (q_chunk + 1) * length, device=device)[:, None]
    k_pos = torch.arange(k_chunk * length, (k_chunk + 1) * length, device=device)[None, :]
    docs = () if documents is None else (documents[:, q_pos], documents[:, k_pos])
    return visible(q_pos, k_pos, causal, window, *docs).reshape(-1, 1, length, length)


def expand_heads(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """[b, groups, L, d] -> [b, groups * repeats, L, d]: each K/V head for its query heads."""
    if repeats == 1:
        return x
    b, g, n, d = x.shape
    return x[:, :, None].expand(b, g, repeats, n, d).reshape(b, g * repeats, n, d)


def _fold(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """The gradient of `expand_heads`: sum the query heads' contributions per K/V head."""
    if repeats == 1:
        return x
    b, h, n, d = x.shape
    return x.view(b, h // repeats, repeats, n, d).sum(2)


def _bias(keep: torch.Tensor, q: torch.Tensor, align: int = 1) -> torch.Tensor:
    """A keep-mask [b|1, 1, Lq, Lk] as the additive bias fused kernels take: 0 or -inf, expanded
    over q's batch and heads (CUDA's memory-efficient kernel refuses a bias that only
    broadcasts, e.g. one mask for the whole batch: a window without documents); rows padded to
    a multiple of `align` and sliced back (that kernel wants aligned rows, as SDPA pads them)."""
    lq, lk = keep.shape[-2:]
    padded = -(-lk // align) * align
    bias = torch.zeros(keep.shape[0], 1, lq, padded, dtype=q.dtype, device=keep.device)
    bias[..., :lk].masked_fill_(~keep, float("-inf"))
    return bias[..., :lk].expand(q.shape[0], q.shape[1], lq, lk)


def _kernel(q: torch.Tensor) -> str:
    if q.device.type == "cuda":
        return "cuda"
    return "cpu" if FUSED_CPU and q.device.type == "cpu" else "math"


def block_forward(q, k, v, causal: bool, scale: float, keep: torch.Tensor | None = None):
    """One block: q [b, h, Lq, d], k and v [b, h, Lk, d] -> (out [b, h, Lq, d], lse [b, h, Lq]
    fp32). `causal`: the diagonal's lower triangle; `keep`: a keep-mask [b|1, 1, Lq, Lk]
    (causality included) instead. A row that sees no key has lse -inf."""
    kernel = _kernel(q)
    if kernel == "math":
        return _math_forward(q, k, v, causal, scale, keep)
    if kernel == "cpu":
        bias = None if keep is None else _bias(keep, q)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        lse = lse.float()
    else:
        out, lse = _cuda_forward(q, k, v, causal, scale, keep)
    if keep is not None:   # a row with no visible key: lse -inf and output 0, whatever the
        seen = keep.any(-1)   # kernel made of it (the CPU kernel gives lse 0)
        out, lse = out.masked_fill(~seen[..., None], 0.0), lse.masked_fill(~seen, float("-inf"))
    return out, lse


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float,
                   keep: torch.Tensor | None = None):
    """One block's (dq, dk, dv), given the whole attention's output and log-sum-exp."""
    kernel = _kernel(q)
    if kernel == "math":
        return _math_backward(dout, q, k, v, out, lse, causal, scale, keep)
    if kernel == "cpu":
        bias = None if keep is None else _bias(keep, q)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    return _cuda_backward(dout, q, k, v, out, lse, causal, scale, keep)


def _flash_on_cuda(q: torch.Tensor, keep) -> bool:
    """Flash takes no mask, half precision only and head sizes that are multiples of 8 up to
    256 (SDPA pads others; these direct calls do not); the memory-efficient kernel the rest."""
    d = q.shape[-1]
    return keep is None and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


def _cuda_forward(q, k, v, causal: bool, scale: float, keep):
    aten = torch.ops.aten
    if _flash_on_cuda(q, keep):
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                scale=scale)
        return out, lse
    bias = None if keep is None else _bias(keep, q, align=16)
    out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal,
                                                               scale=scale)
    return out, lse[..., :q.shape[2]]   # its rows are padded to a multiple of 32


def _cuda_backward(dout, q, k, v, out, lse, causal: bool, scale: float, keep):
    aten = torch.ops.aten
    lq, lk = q.shape[2], k.shape[2]
    if _flash_on_cuda(q, keep):
        # no dropout: the random-state tensors are not read; None = undefined cumulative lengths
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, lq, lk, 0.0, causal, seed, offset, scale=scale)
    bias = None if keep is None else _bias(keep, q, align=16)
    padded = -(-lq // 32) * 32   # the layout its forward returned
    lse = torch.nn.functional.pad(lse, (0, padded - lq)).contiguous()
    seed = offset = torch.empty((), dtype=torch.long, device=q.device)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale)
    return dq, dk, dv


def _scores(q, k, causal: bool, scale: float, keep):
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if keep is not None:
        return scores.masked_fill(~keep, float("-inf"))
    if causal:
        n, m = scores.shape[-2:]
        upper = torch.ones(n, m, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(upper, float("-inf"))
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that see no key) as 0, so exp(-inf - lse) is 0, not NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _math_forward(q, k, v, causal: bool, scale: float, keep):
    scores = _scores(q, k, causal, scale, keep)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - _finite(lse)[..., None]).to(v.dtype), v)
    return out, lse


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float, keep):
    scores = _scores(q, k, causal, scale, keep)
    probs = torch.exp(scores - _finite(lse)[..., None])
    dv = torch.matmul(probs.to(dout.dtype).transpose(-1, -2), dout)
    dprobs = torch.matmul(dout, v.transpose(-1, -2)).float()
    delta = (dout.float() * out.float()).sum(-1, keepdim=True)
    dscores = (probs * (dprobs - delta) * scale).to(q.dtype)
    return torch.matmul(dscores, k), torch.matmul(dscores.transpose(-1, -2), q), dv


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold a block's (output, log-sum-exp) into the running ones, in place (fp32). Rows that
    have seen no key yet (lse -inf on both sides) stay 0."""
    total = torch.logaddexp(lse, block_lse)
    safe = _finite(total)
    out.mul_(torch.exp(lse - safe)[..., None]).add_(
        block_out.float() * torch.exp(block_lse - safe)[..., None])
    lse.copy_(total)


class _Blocks:
    """The blocks of each ring step, with what each needs: the rows of the query and key slots,
    the kernel's causal flag and a keep-mask (MASKED blocks)."""

    def __init__(self, cp: ContextParallel, causal: bool, length: int, window, documents):
        self.cp, self.causal, self.half = cp, causal, length // 2
        self.window, self.documents = window, documents

    def rows(self, slot: int) -> slice:
        return slice(slot * self.half, (slot + 1) * self.half)

    def of_step(self, step: int, device):
        source = (self.cp.rank - step) % self.cp.size
        q_chunks, k_chunks = self.cp.chunks(), chunk_ids(source, self.cp.size)
        for a, j, kind in visible_blocks(q_chunks, k_chunks, self.causal, self.window, self.half,
                                         self.documents is not None):
            keep = None if kind != MASKED else block_keep(
                q_chunks[a], k_chunks[j], self.half, self.causal, self.window, self.documents,
                device)
            yield self.rows(a), self.rows(j), kind == DIAGONAL, keep


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, causal: bool, scale: float, window,
                documents):
        repeats = q.shape[1] // k.shape[1]
        blocks = _Blocks(cp, causal, q.shape[2], window, documents)
        # laid out [b, 2L, heads, d] as torch's kernels lay out theirs: the layer's permute to
        # [2L, b, heads, d] is then a view for b = 1, not a copy the projection keeps
        b, heads, length, d = q.shape
        out = torch.zeros((b, length, heads, d), dtype=torch.float32,
                          device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])   # one contiguous message per step
        for step in range(cp.size):
            incoming, pending = None, None
            if step < cp.size - 1:   # pass the block on while attending to it
                incoming = torch.empty_like(kv)
                pending = cp.exchange(step, {KV: kv}, {KV: incoming})
            for q_rows, k_rows, diagonal, keep in blocks.of_step(step, q.device):
                k_block, v_block = (expand_heads(t[:, :, k_rows], repeats) for t in kv)
                o, s = block_forward(q[:, :, q_rows], k_block, v_block, diagonal, scale, keep)
                _merge(out[:, :, q_rows], lse[:, :, q_rows], o, s)
            if pending is not None:
                pending.wait()
                kv = incoming
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        blocks, scale = ctx.blocks, ctx.scale
        cp = blocks.cp
        dout = dout.contiguous()
        repeats = q.shape[1] // k.shape[1]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        carry = None   # the dK/dV accumulated at the previous step, travelling with its K/V
        for step in range(cp.size):
            sends, receives = {}, {}
            if step < cp.size - 1:
                sends[KV], receives[KV] = kv, torch.empty_like(kv)
            if step > 0:
                sends[GRAD_KV], receives[GRAD_KV] = carry, torch.empty_like(carry)
            pending = cp.exchange(step, sends, receives) if sends else None
            local = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            for q_rows, k_rows, diagonal, keep in blocks.of_step(step, q.device):
                k_block, v_block = (expand_heads(t[:, :, k_rows], repeats) for t in kv)
                dq_a, dk_j, dv_j = block_backward(
                    dout[:, :, q_rows], q[:, :, q_rows], k_block, v_block, out[:, :, q_rows],
                    lse[:, :, q_rows].contiguous(), diagonal, scale, keep)
                dq[:, :, q_rows] += dq_a
                local[0][:, :, k_rows] += _fold(dk_j, repeats)
                local[1][:, :, k_rows] += _fold(dv_j, repeats)
            if pending is not None:
                pending.wait()
            if step > 0:
                local += receives[GRAD_KV]
            if step < cp.size - 1:
                kv = receives[KV]
            carry = local
        if cp.size > 1:   # the last holder of each block hands its gradients to the owner
            home = torch.empty_like(carry)
            cp.exchange(cp.size, {GRAD_KV: carry}, {GRAD_KV: home}).wait()
            carry = home
        return (dq.to(q.dtype), carry[0].to(k.dtype), carry[1].to(v.dtype),
                None, None, None, None, None)


@torch.compiler.disable
def ring_attention(q, k, v, cp: ContextParallel, causal: bool = True, scale: float | None = None,
                   documents: torch.Tensor | None = None, window: int | None = None):
    """q [b, heads, 2L, d], k and v [b, kv_heads, 2L, d] of this rank's two chunks ->
    [b, heads, 2L, d]: attention over the whole sequence of the context group. `documents`:
    [b, s] document ids of the WHOLE sequence (data.reset_attention_mask); `window`: a causal
    sliding window (key j visible to query i iff i - j < window)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, cp, causal, scale, window, documents)
