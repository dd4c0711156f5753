"""fp32 master weights and fp32 gradient accumulation for bf16/fp16 models.

The model computes in bf16 or fp16. Each micro-batch's half-precision gradient is added into
an fp32 `main_grad` as soon as autograd produces it (accumulating m micro-batches in half
precision would lose the small contributions), and AdamW updates fp32 master copies that are
cast back into the model after each step. In fp32 training the master weights are the model's
own parameters and `main_grad` is simply `.grad`.

Storage (`contiguous=True`, the default): the model weights, the masters and the gradients
are views into one flat buffer each (ptdp/optim/buffers.py). Zeroing the gradients and
copying the masters into the model are then one kernel each, and the data-parallel buckets
all-reduce slices of the gradient buffer in place. The masters' `.grad` are bound to
the gradient views once, so `grads_to_masters` has nothing left to do. `contiguous=False`
keeps one storage per tensor: the same arithmetic, the reference the tests compare with.

`MasterWeights` is the replicated kind of the master weights interface (ptdp/optim/weights.py):
every data rank holds all of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ptdp.optim.buffers import FlatGrads, FlatLayout
from ptdp.optim.optimizer import optimizer_moment_bytes
from ptdp.optim.weights import MOMENTS, has_moments, load_optimizer_states
from ptdp.parallel.roles import copy_role, role_of

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}



def grad_of(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient to reduce: fp32 `main_grad` for half-precision params, else `.grad`."""
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def set_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    if hasattr(param, "main_grad"):
        param.main_grad = value
    else:
        param.grad = value


def _master_copy(param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """An fp32 Parameter over `data` (aliased, not copied) with the model weight's role."""
    return copy_role(param, nn.Parameter(data))


class MasterWeights:
    """Pairs each model parameter with the fp32 tensor the optimizer updates.

    `versioned`: the schedule keeps weight versions (ptdp/pipeline/weights.py), which point
    the parameters at tensors of their own, and 2BW holds one batch's gradients while the next
    accumulates: one storage per tensor then, not flat buffers; and in fp32 the optimizer
    steps master objects of their own over the parameters' storage, not the parameter
    objects autograd saved.
    """

    contiguous_default = True   # tests flip it to compare with one storage per tensor
    shard_layout = None         # the data-parallel reduction all-reduces whole gradients
    masters_are_pieces = False  # every replica holds every master whole

    def __init__(self, params: list[nn.Parameter], precision: str, contiguous: bool | None = None,
                 versioned: bool = False):
        self.params = params
        self.half = precision != "fp32"
        self.contiguous = (False if versioned else
                           self.contiguous_default if contiguous is None else contiguous)
        self.flat_grads: FlatGrads | None = None
        if self.contiguous and params:
            self._build_flat()
        elif self.half:
            self.masters = [_master_copy(p, p.detach().float().clone()) for p in params]
            for p in params:
                p.main_grad = None
        elif versioned:   # the same storage, other objects
            self.masters = [copy_role(p, nn.Parameter(p.data, requires_grad=p.requires_grad))
                            for p in params]
        else:
            self.masters = params
        if self.half:
            for p in params:
                p.register_post_accumulate_grad_hook(
                    _add_to_main_grad if self.contiguous else _accumulate_fp32)

    def _build_flat(self) -> None:
        params = self.params
        device, dtype = params[0].device, params[0].dtype
        assert all(p.device == device and p.dtype == dtype for p in params), \
            "one flat buffer needs one device and one dtype"
        layout = FlatLayout([p.shape for p in params])
        grads = layout.allocate(torch.float32, device)
        self.flat_grads = FlatGrads(layout, grads, {id(p): i for i, p in enumerate(params)})
        grad_views = layout.views(grads)
        if not self.half:  # the params are the masters; autograd accumulates into .grad in place
            self.masters = params
            for p, g in zip(params, grad_views):
                p.grad = g
            return
        self.model_buffer = layout.allocate(dtype, device)
        with torch.no_grad():
            for p, view in zip(params, layout.views(self.model_buffer)):
                view.copy_(p)
                p.data = view          # same Parameter object, storage now in the buffer
        self.master_buffer = self.model_buffer.float()
        self.masters = [_master_copy(p, view)
                        for p, view in zip(params, layout.views(self.master_buffer))]
        for p, master, g in zip(params, self.masters, grad_views):
            p.main_grad = g
            master.grad = g

    def zero_grads(self) -> None:
        if self.flat_grads is not None:
            self.flat_grads.buffer.zero_()
            return
        for p in self.params:
            p.grad = None
            if self.half:
                p.main_grad = None

    def grads_to_masters(self) -> None:
        """Hand the reduced fp32 gradients to the master weights (bound once when contiguous)."""
        if self.half and self.flat_grads is None:
            for p, master in zip(self.params, self.masters):
                master.grad = p.main_grad if p.main_grad is not None else torch.zeros_like(master)

    def sync_shared_embeddings(self, group, size: int) -> None:
        """Sum the gradients of the word embedding's two copies (first and last stage)."""
        if size <= 1:
            return
        for master in self.masters:
            if role_of(master).shared_embedding:
                if master.grad is None:
                    master.grad = torch.zeros_like(master)
                dist.all_reduce(master.grad, group=group)

    @torch.no_grad()
    def masters_to_model(self) -> None:
        if not self.half:
            return
        if self.flat_grads is not None:
            self.model_buffer.copy_(self.master_buffer)  # one cast-and-copy kernel
        else:
            torch._foreach_copy_(self.params, self.masters)

    # Whole tensors: the masters are whole already --------------------------------------------
    def master_param_indices(self) -> list[int]:
        return list(range(len(self.params)))

    def full_grads(self) -> list[torch.Tensor | None]:
        return [master.grad for master in self.masters]

    def state_dict(self) -> list[torch.Tensor]:
        return [master.detach() for master in self.masters]

    @torch.no_grad()
    def load_state_dict(self, values: list[torch.Tensor]) -> None:
        for param, master, value in zip(self.params, self.masters, values):
            master.copy_(value)
            if param is not master:
                param.copy_(master)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> list[dict]:
        out = []
        for master in self.masters:
            state = optimizer.state.get(master, {})
            out.append({key: torch.as_tensor(state[key]) for key in (*MOMENTS, "step")
                        if key in state})
        return out

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                  per_param: list[dict]) -> None:
        load_optimizer_states(optimizer, {
            id(master): {"step": saved["step"].clone(), **{key: saved[key] for key in MOMENTS}}
            for master, saved in zip(self.masters, per_param) if has_moments(saved)})

    def state_bytes(self, optimizer) -> int:
        """Bytes of fp32 state kept for the optimizer: masters held apart from the model
        weights (bf16/fp16), and Adam's moments."""
        masters = sum(m.numel() * 4 for m in self.masters) if self.half else 0
        return masters + optimizer_moment_bytes(optimizer)


def _add_to_main_grad(param: nn.Parameter) -> None:
    # Runs before the data-parallel hook (registered first), so that hook sees main_grad.
    param.main_grad.add_(param.grad)
    param.grad = None


def _accumulate_fp32(param: nn.Parameter) -> None:
    grad = param.grad.float()
    param.main_grad = grad if param.main_grad is None else param.main_grad.add_(grad)
    param.grad = None
