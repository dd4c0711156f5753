"""Moving tokens to their experts and computing the experts: the expert group, the all-to-all,
the permutations, and the experts' GEMMs grouped into one autograd Function.

With e expert ranks (ptdp/parallel/grid.py: an expert group is e ranks of one stage with other
data or context coordinates and the same tensor coordinate) each rank holds E/e consecutive
experts: rank r experts [r E/e, (r+1) E/e). A rank sends each (token, choice) row to the rank
holding its expert and gets the rows other ranks send to its experts; after the experts ran,
the rows go back the same way. Both are `dist.all_to_all_single` with uneven splits (gloo and
NCCL): the row counts are exchanged first (`exchange_counts`, an even all-to-all of E counts),
then the rows (`all_to_all`, an autograd Function whose backward is the reverse all-to-all).
Every expert rank issues the same all-to-alls in the same order: all of them run the same
layer of the same micro-batch at the same step of the same schedule, forward and backward.

Permutations (`permute`): the rows sorted by expert are a gather of the tokens, each token k
times; putting the outputs back is a gather by the inverse permutation. Autograd's gradient of
a gather (`index_select`) is a zero-filled tensor and a scatter-add into it; a permutation's
gradient is the gather by its inverse, and the k copies of a token are summed as a [N, k, h]
view, so neither direction fills or scatters.

Grouped GEMMs (`grouped_linear`): the rows of E experts, contiguous per expert, times each
expert's weight, as one Function whose backward computes the input's gradient at once and the
weights' gradients either at once or, under zb-h1, as a deferred closure of the chunk's
WeightGradQueue (ptdp/parallel/weight_grad.py), like every other weighted product.
`torch._grouped_mm` (one kernel for all experts, no host sync for the group sizes) does the
products where it has a fast kernel, bf16 on CUDA; elsewhere one `torch.mm` per expert writes
into its rows of a preallocated output (on this 2-core CPU `_grouped_mm` is the same loop plus
a stacking copy of the weights: measured slower).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ptdp.parallel.weight_grad import WeightGradQueue


@dataclass
class ExpertParallel:
    """The expert group and this rank's place in it (size 1: every rank holds every expert)."""

    group: object = None
    rank: int = 0
    size: int = 1

    @classmethod
    def from_grid(cls, grid) -> "ExpertParallel":
        if getattr(grid, "e", 1) == 1:
            return cls()
        return cls(grid.group("expert"), grid.index("expert"), grid.size("expert"))

    def held(self, num_experts: int) -> range:
        """The global indices of the experts this rank holds."""
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


def exchange_counts(counts: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """counts [E] (rows this rank sends to each expert) -> [e, E/e]: the rows each rank of the
    group sends to each of this rank's experts."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=ep.group)
    return received.view(ep.size, -1)


class _AllToAll(torch.autograd.Function):
    """Rows [sum(send), ...] -> [sum(receive), ...]: send[r] rows to rank r, receive[r] from it.
    Backward: the gradients go back the same way reversed."""

    @staticmethod
    def forward(ctx, rows, ep: ExpertParallel, send: list[int], receive: list[int]):
        ctx.ep, ctx.send, ctx.receive = ep, send, receive
        return _exchange(rows, ep, send, receive)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.ep, ctx.receive, ctx.send), None, None, None


def _exchange(rows: torch.Tensor, ep: ExpertParallel, send: list[int],
              receive: list[int]) -> torch.Tensor:
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=receive,
                           input_split_sizes=send, group=ep.group)
    return out


def all_to_all(rows: torch.Tensor, ep: ExpertParallel, send: list[int],
               receive: list[int]) -> torch.Tensor:
    return _AllToAll.apply(rows, ep, send, receive)


def by_local_expert(received: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """The rows an all-to-all delivered, source rank by source rank and within each by local
    expert (`received[r][j]` rows from rank r for local expert j), reordered by local expert
    (within each, by source rank): (that permutation, rows per local expert). A loop over
    ranks and experts, never over tokens."""
    starts, offset = [], 0
    for row in received:
        starts.append([])
        for count in row:
            starts[-1].append(offset)
            offset += count
    pieces = [torch.arange(starts[r][j], starts[r][j] + received[r][j])
              for j in range(len(received[0])) for r in range(len(received))]
    order = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    return order, [sum(row[j] for row in received) for j in range(len(received[0]))]


# --------------------------------------------------------------------------------------------
# Permutations
# --------------------------------------------------------------------------------------------

def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """inverse[order[i]] = i (a scatter: cheaper than sorting `order` again)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


class _Permute(torch.autograd.Function):
    """out = x[index], where `index` holds every row of x `copies` times, the copies of row t at
    the positions inverse[t * copies + j]. Backward: grad_x[t] = sum_j grad[inverse[t copies + j]],
    a gather and a sum over a [N, copies, ...] view."""

    @staticmethod
    def forward(ctx, x, index, inverse, copies: int):
        ctx.save_for_backward(inverse)
        ctx.copies = copies
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        grad = grad.index_select(0, inverse)
        if ctx.copies > 1:
            grad = grad.view(-1, ctx.copies, *grad.shape[1:]).sum(1)
        return grad, None, None, None


def permute(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor,
            copies: int = 1) -> torch.Tensor:
    """x[index] with a gather for its gradient (`_Permute`); `inverse` as `_Permute` says."""
    return _Permute.apply(x, index, inverse, copies)


# --------------------------------------------------------------------------------------------
# Grouped GEMMs
# --------------------------------------------------------------------------------------------

@dataclass
class Groups:
    """Rows per expert, contiguous and in expert order: `sizes` (host ints, the loop's splits)
    or `ends` (int32 cumulative row counts on the rows' device, `torch._grouped_mm`'s offsets,
    which need no host sync)."""

    sizes: list[int] | None = None
    ends: torch.Tensor | None = None

    @classmethod
    def of(cls, counts: torch.Tensor | list[int], like: torch.Tensor,
           widths: tuple[int, ...]) -> "Groups":
        """The groups of `counts` rows per expert, for rows of `like`'s dtype and device through
        weights of inner sizes `widths`."""
        if not uses_grouped_mm(like, widths):
            return cls(sizes=counts if isinstance(counts, list) else counts.tolist())
        counts = torch.as_tensor(counts, device=like.device)
        return cls(ends=counts.cumsum(0).to(torch.int32))


def uses_grouped_mm(rows: torch.Tensor, widths: tuple[int, ...]) -> bool:
    """Whether the experts run as `torch._grouped_mm`: bf16 on CUDA, its fast kernel, whose
    operands' strides must be multiples of 16 bytes (every width a multiple of 8)."""
    return (rows.is_cuda and rows.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and all(width % 8 == 0 for width in widths))


def _parts(weight: torch.Tensor, halves: int) -> list[torch.Tensor]:
    """A weight's row sets: all rows, or (halves = 2) its even rows and its odd rows (the gate
    and up rows of a SwiGLU fc1, which alternate), as strided views: no copy."""
    return [weight[j::halves] for j in range(halves)]


def _stacked(weights, j: int, halves: int) -> torch.Tensor:
    """Row set j of every expert's weight, stacked: [E, out / halves, in] (a copy)."""
    return torch.stack([w[j::halves] for w in weights])


def _products(x: torch.Tensor, weights, groups: Groups, halves: int) -> list[torch.Tensor]:
    """Rows of expert i times each row set of weights[i] (transposed): `halves` tensors
    [R, out / halves], each contiguous."""
    if groups.ends is not None:
        return [torch._grouped_mm(x, _stacked(weights, j, halves).transpose(1, 2),
                                  offs=groups.ends) for j in range(halves)]
    outs = [x.new_empty(x.shape[0], weights[0].shape[0] // halves) for _ in range(halves)]
    pieces = [out.split(groups.sizes) for out in outs]
    for i, part in enumerate(x.split(groups.sizes)):
        for j, weight in enumerate(_parts(weights[i], halves)):
            torch.mm(part, weight.t(), out=pieces[j][i])
    return outs


def _input_grad(grads: list[torch.Tensor], weights, groups: Groups) -> torch.Tensor:
    """The rows' gradient [R, in]: sum over row sets j of grads[j] (of expert i's rows) times
    row set j of weights[i]."""
    halves = len(grads)
    if groups.ends is not None:
        return sum(torch._grouped_mm(g, _stacked(weights, j, halves), offs=groups.ends)
                   for j, g in enumerate(grads))
    out = grads[0].new_empty(grads[0].shape[0], weights[0].shape[1])
    pieces = [g.split(groups.sizes) for g in grads]
    for i, into in enumerate(out.split(groups.sizes)):
        for j, weight in enumerate(_parts(weights[i], halves)):
            if j == 0:
                torch.mm(pieces[j][i], weight, out=into)
            else:
                into.addmm_(pieces[j][i], weight)
    return out


@torch.no_grad()   # the W pass of zb-h1 calls it outside a backward, with grad mode on
def _weight_grads(grads: list[torch.Tensor], x: torch.Tensor, groups: Groups) -> list:
    """Each expert's weight gradient [out, in], its row set j = grads[j]_i^T x_i (zeros for an
    expert without rows)."""
    halves = len(grads)
    if groups.ends is not None:
        sets = [torch._grouped_mm(g.t(), x, offs=groups.ends) for g in grads]   # [E, out/h, in]
        grad = sets[0] if halves == 1 else torch.stack(sets, dim=2).flatten(1, 2)
        return list(grad.unbind(0))
    pieces, rows = [g.split(groups.sizes) for g in grads], x.split(groups.sizes)
    out = []
    for i, part in enumerate(rows):
        grad = x.new_empty(halves * grads[0].shape[1], x.shape[1])
        for j, into in enumerate(_parts(grad, halves)):
            torch.mm(pieces[j][i].t(), part, out=into)
        out.append(grad)
    return out


class _GroupedLinear(torch.autograd.Function):
    """x [R, in] -> `halves` tensors [R, out / halves]: rows of expert i times each row set of
    weights[i] (transposed). With a queue, the weights enter detached and their gradients go
    to `queue.collect` (as ptdp/parallel/deferred_ops.py's deferred linear does); without one they are
    returned to autograd."""

    @staticmethod
    def forward(ctx, x, groups: Groups, halves: int, queue, params, trigger, *weights):
        ctx.save_for_backward(x, *weights)
        ctx.groups, ctx.queue, ctx.params = groups, queue, params
        return tuple(_products(x, weights, groups, halves))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        grads = [g.contiguous() for g in grads]
        grad_x = _input_grad(grads, weights, ctx.groups) if ctx.needs_input_grad[0] else None
        nones = (None,) * 5
        if ctx.queue is None:
            if not any(ctx.needs_input_grad[6:]):
                return (grad_x, *nones, *(None,) * len(weights))
            return (grad_x, *nones, *_weight_grads(grads, x, ctx.groups))
        ctx.queue.collect(list(ctx.params), lambda: _weight_grads(grads, x, ctx.groups))
        return (grad_x, *nones, *(None,) * len(weights))


def grouped_linear(x: torch.Tensor, weights: list[torch.Tensor], groups: Groups, weight_ops,
                   halves: int = 1) -> tuple[torch.Tensor, ...]:
    """The experts' products (`_GroupedLinear`), as `halves` tensors: a SwiGLU fc1 (halves = 2)
    gives its gate and its up products apart, each contiguous, so the activation's backward
    writes no strided halves. `weight_ops` is the experts' (PLAIN, or zb-h1's queue)."""
    if not isinstance(weight_ops, WeightGradQueue):
        return _GroupedLinear.apply(x, groups, halves, None, None, None, *weights)
    # detached weights and an input that requires grad, as deferred_ops.py's ops (it says why)
    return _GroupedLinear.apply(x, groups, halves, weight_ops, tuple(weights),
                                weight_ops._trigger(x.device),
                                *(w.detach() for w in weights))
