"""Random streams: the default generator (same on every tensor and data rank, distinct per
pipeline stage) and the tensor-parallel stream for dropout inside tensor-parallel regions."""

from __future__ import annotations

import contextlib

import torch


TENSOR_RNG_OFFSET = 2718


class TensorParallelRNG:
    """A second RNG stream for dropout *inside* tensor-parallel regions.

    Activations inside a tensor-parallel region (e.g. attention probabilities of this rank's
    heads) are different tensors on each rank, so their dropout masks must differ: that stream
    is seeded with the tensor rank. Activations outside (the replicated hidden state) must be
    dropped identically on every tensor rank, so they use the default torch generator, which
    is seeded identically across the tensor group.
    """

    def __init__(self, seed: int, tp_rank: int, device: torch.device):
        self.device = torch.device(device)
        self._state = self._fresh_state(seed + TENSOR_RNG_OFFSET + tp_rank)

    def _fresh_state(self, seed: int) -> torch.Tensor:
        saved = self._get()
        torch.manual_seed(seed) if self.device.type == "cpu" else torch.cuda.manual_seed(seed)
        state = self._get()
        self._set(saved)
        return state

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def get_state(self) -> torch.Tensor:
        return self._state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state.clone()

    @contextlib.contextmanager
    def fork(self):
        """Run the body with the tensor-parallel stream, then restore the default stream."""
        default = self._get()
        self._set(self._state)
        try:
            yield
        finally:
            self._state = self._get()
            self._set(default)


def seed_everything(seed: int, pp_rank: int) -> None:
    """Default generator: same across tensor and data ranks, distinct per pipeline stage."""
    torch.manual_seed(seed + 100 * pp_rank)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed + 100 * pp_rank)


class RandomStreams:
    """A rank's random streams, as a checkpoint saves them: the default generator (CPU, and
    CUDA on a GPU), seeded per pipeline stage, and the tensor-parallel stream."""

    def __init__(self, seed: int, pp_rank: int, tp_rank: int, device: torch.device):
        self.pp_rank, self.tp_rank, self.device = pp_rank, tp_rank, torch.device(device)
        seed_everything(seed, pp_rank)
        self.tensor_parallel = TensorParallelRNG(seed, tp_rank, device)

    def state_dict(self) -> dict:
        state = {"cpu": torch.get_rng_state(), "tensor_parallel": self.tensor_parallel.get_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        self.tensor_parallel.set_state(state["tensor_parallel"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def reseed(self, seed: int) -> None:
        """Fresh streams from `seed`, as the start of a run with that seed would have them."""
        seed_everything(seed, self.pp_rank)
        fresh = TensorParallelRNG(seed, self.tp_rank, self.device)
        self.tensor_parallel.set_state(fresh.get_state())
