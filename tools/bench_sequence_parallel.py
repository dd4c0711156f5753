"""Benchmark (not a test): per-rank activation memory of a transformer layer with and without
sequence parallelism, by region, measured on t local CPU ranks.

Each rank builds one TransformerLayer of its tensor group (the same code the trainer runs),
runs its forward with dropout on and counts the bytes autograd keeps for backward (unique
storages, parameters excluded; ptdp.planner.profiler.saved_bytes), attributing each saved
tensor to the region that saved it:

* ``layernorm``   ln1 and ln2 (their inputs and statistics),
* ``dropout+add`` the bias + dropout + residual chains after attention and MLP (the masks),
* ``layer input`` the [s, b, h] (or [s/t, b, h]) input the next layer's backward needs,
* ``attention`` / ``mlp`` the tensor-parallel regions (QKV, scores, GEMM inputs, GeLU).

The first three are what sequence parallelism splits along the sequence: their bytes should
drop by t. The tensor-parallel regions already hold 1/t of their heads/columns, except the
GEMMs' inputs, which this implementation saves all-gathered (Megatron-LM re-gathers them in
backward instead; not done here), so those stay as they are.

    python tools/bench_sequence_parallel.py --tensor 2 4 --out bench/sequence_parallel
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__:      # python -m tools.bench_sequence_parallel, or imported by a test
    from . import harness
else:                # python tools/bench_sequence_parallel.py (tools/harness.py says why)
    import harness

SHARDED = ("layernorm", "dropout+add", "layer input")
REGIONS = SHARDED + ("attention", "mlp")


def _region_of(name: str) -> str:
    if name.startswith(("ln1", "ln2")):
        return "layernorm"
    if name.startswith("attention"):
        return "attention"
    if name.startswith("mlp"):
        return "mlp"
    return "dropout+add"


def measure(args: dict, sequence_parallel: bool) -> dict:
    """On every rank of a t-rank world: bytes saved by one layer's forward, by region."""
    import torch
    import torch.distributed as dist
    from ptdp.models.transformer import ModelContext, TransformerLayer
    from ptdp.config import ModelConfig, padded_vocab_size
    from ptdp.parallel.mappings import TensorParallel
    from ptdp.parallel.rng import TensorParallelRNG

    t, rank = dist.get_world_size(), dist.get_rank()
    cfg = ModelConfig(num_layers=1, hidden_size=args["hidden"], num_heads=args["heads"],
                      seq_length=args["seq"], vocab_size=128, dropout=0.1)
    tp = TensorParallel(dist.group.WORLD, rank, t, sequence_parallel and t > 1)
    ctx = ModelContext(cfg, tp, 1234, TensorParallelRNG(1234, rank, "cpu"),
                       padded_vocab_size(128, t))
    layer = TransformerLayer(ctx, 0, causal=True).train()
    seq = cfg.seq_length // (t if tp.sequence_parallel else 1)
    x = torch.randn(seq, args["batch"], cfg.hidden_size, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    current, seen = ["dropout+add"], {}
    for name, module in layer.named_modules():
        if name in ("ln1", "ln2", "attention", "mlp"):
            module.register_forward_pre_hook(lambda m, a, n=name: current.append(_region_of(n)))
            module.register_forward_hook(lambda m, a, o: current.pop() and None)  # keep o

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            region = "layer input" if ptr == x.untyped_storage().data_ptr() else current[-1]
            seen[ptr] = (region, tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    out.sum().backward()
    row = {region: 0 for region in REGIONS}
    for region, nbytes in seen.values():
        row[region] += nbytes
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensor", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", default="bench/sequence_parallel")
    a = parser.parse_args(argv)
    from ptdp.runtime.local_ranks import run_on_ranks
    shape = {"hidden": a.hidden, "heads": a.heads, "seq": a.seq, "batch": a.batch}
    rows = []
    for t in a.tensor:
        for sp in (False, True):
            per_rank = run_on_ranks(t, measure, shape, sp, timeout_s=300)
            rows.append({"t": t, "sequence_parallel": sp, "rank0": per_rank[0],
                         "ranks_equal": all(r == per_rank[0] for r in per_rank)})
    print(f"activation bytes saved by one layer's forward, per rank (h={a.hidden}, "
          f"s={a.seq}, b={a.batch}, fp32, dropout 0.1)")
    header = f"{'t':>2} {'SP':>3} " + " ".join(f"{r:>12}" for r in REGIONS) + f" {'sharded':>10} {'ratio':>6}"
    print(header)
    for row in rows:
        sharded = sum(row["rank0"][r] for r in SHARDED)
        base = next(r for r in rows if r["t"] == row["t"] and not r["sequence_parallel"])
        row["sharded_bytes"] = sharded
        row["sharded_ratio"] = sum(base["rank0"][r] for r in SHARDED) / sharded
        print(f"{row['t']:>2} {'yes' if row['sequence_parallel'] else 'no':>3} "
              + " ".join(f"{row['rank0'][r]:>12,}" for r in REGIONS)
              + f" {sharded:>10,} {row['sharded_ratio']:>6.2f}")
    out = harness.write_json(Path(a.out) / "activation_memory.json",
                             {"shape": shape, "rows": rows}, tool=__file__, argv=argv)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
