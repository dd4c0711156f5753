"""Benchmark (not a test): one mixture-of-experts MLP forward + backward against a dense MLP of
the same active FLOPs and against a per-token loop, in the same run, on one rank.

* ``moe``: the MLP of a TransformerLayer built from a ModelConfig with model.num_experts = E
  (ptdp.models.moe, the module the model itself builds for an MoE layer), on one rank
  (t = e = 1): the router, E experts of width f_moe, each token through its top k;
* ``dense``: the dense ParallelMLP of the same layer built with num_experts = 0 and
  ffn_hidden_size = k * f_moe, which does the experts' FLOPs (k * 2(2+g) h f_moe per token)
  without the router or the permutation: the model's own dense MLP, unchanged;
* ``dense-halves`` (SwiGLU only): that dense MLP with its gate and up weights apart, so its
  activation runs on contiguous halves as the MoE experts' does (models/moe.py); the dense MLP
  computes the same values on fc1's interleaved columns, whose strided backward costs more.
  The MoE's own overhead (router, permutations, per-expert GEMMs) is its ratio to this row;
* ``per-token``: `PerTokenMoE`, the plainest implementation of the same mixture: the same
  router and experts as loose tensors, a Python loop over the tokens, each through its k experts
  (slow: timed on the first --loop-tokens tokens and scaled to all, it is linear in them).

The cases run in one process, same dtype (fp32) and threads, on the same input; their timed
steps alternate (moe, dense, dense-halves, moe, ...) so that the machine's load drifts hit every
case alike. Each row: the median and the fastest seconds of a forward + backward of b*s tokens
(the input's gradient and every weight's), and the ratio of medians to the dense MLP. The
issue's goal on a 2-core CPU: the MoE MLP with E = 8, k = 2 within 1.3x the dense MLP.

    python tools/bench_moe.py --experts 8 --top-k 2 --out bench/moe
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__:      # python -m tools.bench_moe, or imported by a test
    from . import harness
else:                # python tools/bench_moe.py (tools/harness.py says why)
    import harness


def model_config(args, experts: int, ffn: int):
    """A one-layer Llama-style model: SwiGLU experts (--activation gelu: GeLU ones)."""
    from ptdp.config import ModelConfig
    moe = dict(num_experts=experts, moe_top_k=args.top_k, moe_ffn_hidden_size=args.moe_ffn,
               moe_aux_loss_coeff=0.0) if experts else {}
    return ModelConfig(arch="gpt", preset="llama", num_layers=1, hidden_size=args.hidden,
                       num_heads=args.heads, num_kv_heads=args.heads, ffn_hidden_size=ffn,
                       seq_length=args.seq, vocab_size=128, activation=args.activation,
                       dropout=0.0, **moe)


def layer_mlp(cfg):
    """The MLP the model builds for layer 0 of `cfg`: through TransformerLayer, on one rank."""
    import torch.distributed as dist
    from ptdp.config import padded_vocab_size
    from ptdp.models.transformer import ModelContext, TransformerLayer
    from ptdp.parallel.mappings import TensorParallel
    from ptdp.parallel.rng import TensorParallelRNG

    tp = TensorParallel(dist.group.WORLD, 0, 1, False)
    ctx = ModelContext(cfg, tp, 1234, TensorParallelRNG(1234, 0, "cpu"),
                       padded_vocab_size(cfg.vocab_size, 1))
    return TransformerLayer(ctx, 0, causal=True).mlp.train()


def _output(result):
    """An MLP's output tensor: ParallelMLP returns (output, fc2's bias or None); an MoE block
    may return more (its side outputs), which the timing leaves out."""
    import torch
    if isinstance(result, torch.Tensor):
        return result
    out, bias = result[0], (result[1] if len(result) > 1 else None)
    if isinstance(bias, torch.Tensor) and bias.shape == out.shape[-1:]:
        out = out + bias
    return out


class PerTokenMoE:
    """The per-token loop reference: router logits in fp32, softmax, top-k weights
    renormalised, then for every token and each of its k experts fc1, the activation, fc2."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, gated: bool, seed=0):
        import torch
        g = torch.Generator().manual_seed(seed)
        self.top_k, self.gated = top_k, gated
        width = (2 if gated else 1) * ffn
        self.router = (torch.randn(experts, hidden, generator=g) * 0.02).requires_grad_()
        self.fc1 = (torch.randn(experts, width, hidden, generator=g) * 0.02).requires_grad_()
        self.fc2 = (torch.randn(experts, hidden, ffn, generator=g) * 0.02).requires_grad_()

    def parameters(self):
        return [self.router, self.fc1, self.fc2]

    def route(self, x):
        import torch
        probs = torch.softmax((x @ self.router.t()).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), experts

    def _expert(self, e: int, x):
        import torch.nn.functional as F
        hidden = x @ self.fc1[e].t()        # x: [h] (one token) or [n, h]
        if self.gated:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden)
        return hidden @ self.fc2[e].t()

    def __call__(self, x):
        """x: [tokens, h] -> [tokens, h], one token at a time."""
        import torch
        weights, experts = self.route(x)
        rows = []
        for i in range(x.shape[0]):
            rows.append(sum(weights[i, j] * self._expert(int(experts[i, j]), x[i])
                            for j in range(self.top_k)))
        return torch.stack(rows)

    def batched(self, x):
        """The same mixture, each expert over all its tokens at once (checks the loop)."""
        import torch
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        for e in range(self.fc1.shape[0]):
            token, slot = (experts == e).nonzero(as_tuple=True)
            if len(token):
                rows = self._expert(e, x[token])
                out = out.index_add(0, token, weights[token, slot, None] * rows)
        return out


class DenseHalves:
    """`dense`'s MLP with its fc1 split into a gate and an up weight (contiguous copies of its
    even and odd rows): SiLU(x Wg^T) * (x Wu^T), then fc2, the same values."""

    def __init__(self, dense):
        import torch
        assert dense.fc1.bias is None and dense.fc2.bias is None, "the llama preset: no biases"
        fc1 = dense.fc1.weight.detach()
        self.gate, self.up = (fc1[j::2].clone().requires_grad_() for j in range(2))
        self.fc2 = dense.fc2.weight.detach().clone().requires_grad_()
        self._silu = torch.nn.functional.silu

    def parameters(self):
        return [self.gate, self.up, self.fc2]

    def __call__(self, x):
        import torch.nn.functional as F
        return F.linear(self._silu(F.linear(x, self.gate)) * F.linear(x, self.up), self.fc2)


def forward_backward(module, x, grad):
    """One timed step: forward, then backward of `grad` into the input and every weight."""
    for p in module.parameters():
        p.grad = None
    x.grad = None
    _output(module(x)).backward(grad)


def time_alternating(cases: dict, x, steps: int, warmup: int) -> dict:
    """{name: [seconds of each timed step]}: the cases' steps alternate, after `warmup` rounds
    (tools/harness.py's `alternating`)."""
    import torch
    grad = torch.ones_like(x)
    rounds = harness.alternating(
        {name: lambda _, module=module: forward_backward(module, x, grad)
         for name, module in cases.items()}, steps, warmup)
    return {name: [laps[name].wall for laps in rounds] for name in cases}


def _row(case: str, seconds: list[float], scale: float = 1.0, **extra) -> dict:
    import statistics
    return {"case": case, "seconds": statistics.median(seconds) * scale,
            "fastest": min(seconds) * scale, **extra}


def measure(args) -> list[dict]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.seq, args.batch, args.hidden, requires_grad=True)
    with harness.world_of_one():
        cases = {"moe": layer_mlp(model_config(args, args.experts, args.moe_ffn)),
                 "dense": layer_mlp(model_config(args, 0, args.top_k * args.moe_ffn))}
        if args.activation == "swiglu":
            cases["dense-halves"] = DenseHalves(cases["dense"])
        timed = time_alternating(cases, x, args.steps, args.warmup)
    rows = [_row(name, seconds) for name, seconds in timed.items()]
    loop = PerTokenMoE(args.hidden, args.moe_ffn, args.experts, args.top_k,
                       args.activation == "swiglu")
    tokens = args.seq * args.batch
    some = min(tokens, args.loop_tokens or tokens)
    flat = x.detach().reshape(-1, args.hidden)[:some].clone().requires_grad_()
    looped = time_alternating({"per-token": loop}, flat, args.loop_steps, 0)["per-token"]
    rows.append(_row("per-token", looped, tokens / some, timed_tokens=some))
    for row in rows:
        row["vs_dense"] = row["seconds"] / rows[1]["seconds"]
    return rows


def shape(args) -> str:
    """The benchmark's shape, for the table's heading and the JSON."""
    import torch
    return (f"E={args.experts} k={args.top_k} h={args.hidden}, expert width {args.moe_ffn} "
            f"({args.activation}), dense width k*{args.moe_ffn}={args.top_k * args.moe_ffn}; "
            f"{args.seq * args.batch} tokens (s={args.seq}, b={args.batch}); fp32, "
            f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY {wait_policy()}; "
            f"forward+backward, {args.steps} alternating steps after {args.warmup} warm-up")


def load_average() -> str:
    """The machine's 1-minute load average: the many small GEMMs of E experts suffer more than
    the dense MLP's few large ones when other processes take the cores (docs/moe.md)."""
    import os
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "n/a"


def wait_policy() -> str:
    """OpenMP's wait policy from the environment (docs/moe.md: under load, spinning threads
    decide the timings)."""
    import os
    return os.environ.get("OMP_WAIT_POLICY", "default")


def table(rows: list[dict]) -> str:
    def case(r):
        return r["case"] + (f" (from {r['timed_tokens']} tokens)" if "timed_tokens" in r else "")
    return harness.table(["case", "median s", "fastest s", "vs dense"],
                         [[case(r), f"{r['seconds']:.4f}", f"{r['fastest']:.4f}",
                           f"{r['vs_dense']:.2f}x"] for r in rows], align="<")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=8, help="E")
    parser.add_argument("--top-k", type=int, default=2, help="k")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--moe-ffn", type=int, default=704, help="each expert's width")
    parser.add_argument("--activation", choices=("swiglu", "gelu"), default="swiglu")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--loop-steps", type=int, default=1, help="timed per-token loop steps")
    parser.add_argument("--loop-tokens", type=int, default=64,
                        help="tokens the per-token loop is timed on, scaled to all (0: all)")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads for every case (0: torch's default)")
    parser.add_argument("--out", default="bench/moe", help="folder for result.json")
    args = parser.parse_args(argv)
    if args.experts < 1 or not 1 <= args.top_k <= args.experts:
        parser.error("need --experts >= 1 and 1 <= --top-k <= --experts")
    load = [load_average()]
    rows = measure(args)
    load.append(load_average())
    print(f"{shape(args)}; load average {load[0]} before, {load[1]} after")
    print(table(rows))
    path = harness.write_json(Path(args.out) / "result.json",
                              {"args": vars(args), "shape": shape(args), "load_average": load,
                               "rows": rows},
                              tool=__file__, argv=argv)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
