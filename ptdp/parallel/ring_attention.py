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

Inside a rank, blocks run torch's fused kernels that return the log-sum-exp:
`_scaled_dot_product_flash_attention_for_cpu` on CPU (memory linear in the block length) and a
plain matmul/softmax elsewhere. Grouped-query attention sends the smaller K/V (num_kv_heads)
and expands them to the query heads per block only.
"""

from __future__ import annotations

import torch

from ptdp.parallel.context import GRAD_KV, KV, ContextParallel, chunk_ids

FULL, DIAGONAL = "full", "diagonal"
FUSED_CPU = True   # CPU blocks through torch's flash kernel (tests switch to the math path)


def _fused(q: torch.Tensor) -> bool:
    return FUSED_CPU and q.device.type == "cpu"


def visible_blocks(q_chunks: tuple, k_chunks: tuple, causal: bool) -> list[tuple[int, int, str]]:
    """(query slot, key slot, FULL or DIAGONAL) of every block with something to attend to."""
    out = []
    for a, qc in enumerate(q_chunks):
        for j, kc in enumerate(k_chunks):
            if not causal or kc < qc:
                out.append((a, j, FULL))
            elif kc == qc:
                out.append((a, j, DIAGONAL))
    return out


def _expand(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """[b, groups, L, d] -> [b, groups * repeats, L, d]: each K/V head for its query heads."""
    if repeats == 1:
        return x
    b, g, n, d = x.shape
    return x[:, :, None].expand(b, g, repeats, n, d).reshape(b, g * repeats, n, d)


def _fold(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """The gradient of `_expand`: sum the query heads' contributions per K/V head."""
    if repeats == 1:
        return x
    b, h, n, d = x.shape
    return x.view(b, h // repeats, repeats, n, d).sum(2)


def block_forward(q, k, v, causal: bool, scale: float):
    """One block: q [b, h, Lq, d], k and v [b, h, Lk, d] -> (out [b, h, Lq, d], lse [b, h, Lq]
    fp32)."""
    if _fused(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse.float()
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if causal:
        scores = scores.masked_fill(_upper(scores), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v)
    return out, lse


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """One block's (dq, dk, dv), given the whole attention's output and log-sum-exp."""
    if _fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if causal:
        scores = scores.masked_fill(_upper(scores), float("-inf"))
    probs = torch.exp(scores - lse[..., None])
    dv = torch.matmul(probs.to(dout.dtype).transpose(-1, -2), dout)
    dprobs = torch.matmul(dout, v.transpose(-1, -2)).float()
    delta = (dout.float() * out.float()).sum(-1, keepdim=True)
    dscores = (probs * (dprobs - delta) * scale).to(q.dtype)
    return torch.matmul(dscores, k), torch.matmul(dscores.transpose(-1, -2), q), dv


def _upper(scores: torch.Tensor) -> torch.Tensor:
    n, m = scores.shape[-2:]
    return torch.ones(n, m, dtype=torch.bool, device=scores.device).triu(1)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold a block's (output, log-sum-exp) into the running ones, in place (fp32)."""
    total = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - total)[..., None]).add_(
        block_out.float() * torch.exp(block_lse - total)[..., None])
    lse.copy_(total)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, causal: bool, scale: float):
        repeats = q.shape[1] // k.shape[1]
        half = q.shape[2] // 2
        rows = lambda slot: slice(slot * half, (slot + 1) * half)  # noqa: E731
        # laid out [b, 2L, heads, d] as torch's kernels lay out theirs: the layer's permute to
        # [2L, b, heads, d] is then a view for b = 1, not a copy the projection keeps
        b, heads, length, d = q.shape
        out = torch.zeros((b, length, heads, d), dtype=torch.float32,
                          device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])   # one contiguous message per step
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            incoming, pending = None, None
            if step < cp.size - 1:   # pass the block on while attending to it
                incoming = torch.empty_like(kv)
                pending = cp.exchange(step, {KV: kv}, {KV: incoming})
            blocks = visible_blocks(cp.chunks(), chunk_ids(source, cp.size), causal)
            for a, j, kind in blocks:
                q_rows, k_rows = rows(a), rows(j)
                o, s = block_forward(q[:, :, q_rows], _expand(kv[0][:, :, k_rows], repeats),
                                     _expand(kv[1][:, :, k_rows], repeats), kind == DIAGONAL,
                                     scale)
                _merge(out[:, :, q_rows], lse[:, :, q_rows], o, s)
            if pending is not None:
                pending.wait()
                kv = incoming
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.cp, ctx.causal, ctx.scale = cp, causal, scale
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, causal, scale = ctx.cp, ctx.causal, ctx.scale
        dout = dout.contiguous()
        repeats = q.shape[1] // k.shape[1]
        half = q.shape[2] // 2
        rows = lambda slot: slice(slot * half, (slot + 1) * half)  # noqa: E731
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        carry = None   # the dK/dV accumulated at the previous step, travelling with its K/V
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            sends, receives = {}, {}
            if step < cp.size - 1:
                sends[KV], receives[KV] = kv, torch.empty_like(kv)
            if step > 0:
                sends[GRAD_KV], receives[GRAD_KV] = carry, torch.empty_like(carry)
            pending = cp.exchange(step, sends, receives) if sends else None
            local = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            for a, j, kind in visible_blocks(cp.chunks(), chunk_ids(source, cp.size), causal):
                q_rows, k_rows = rows(a), rows(j)
                dq_a, dk_j, dv_j = block_backward(
                    dout[:, :, q_rows], q[:, :, q_rows], _expand(kv[0][:, :, k_rows], repeats),
                    _expand(kv[1][:, :, k_rows], repeats), out[:, :, q_rows],
                    lse[:, :, q_rows].contiguous(), kind == DIAGONAL, scale)
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
        return (dq.to(q.dtype), carry[0].to(k.dtype), carry[1].to(v.dtype), None, None, None)


@torch.compiler.disable
def ring_attention(q, k, v, cp: ContextParallel, causal: bool = True, scale: float | None = None):
    """q [b, heads, 2L, d], k and v [b, kv_heads, 2L, d] of this rank's two chunks ->
    [b, heads, 2L, d]: attention over the whole sequence of the context group."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, cp, causal, scale)
