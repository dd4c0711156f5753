"""Benchmark (not a test): where a GeLU MLP's biases are added, compiled, forward + backward.

A GPT layer's MLP is fc1, bias + GeLU, fc2, bias + residual. ptdp's layers hand the biases to
the fused chains of ptdp/kernels/fused.py; this times that block three ways, each through
torch.compile (off with --no-compile), in alternating rounds:

* `rows`: as ptdp's layers run it, through their own `residual_mlp_on_rows`
  (models/transformer.py): the tokens as one [s * b, h] matrix, the GEMMs without bias,
  `bias_gelu` after fc1, fc2's bias added into its output, which is viewed back to
  [s, b, h] for the residual add;
* `sbh`: the same functions on [s, b, h] (ptdp's layers until 2026-11-27);
* `addmm`: the biases inside the GEMMs (`F.linear(x, w, b)`), as the compiled reference of
  tools/bench_gpu.py does.

On one H200 at GPT-1.3B's shape, inductor compiled `sbh`'s bias-GeLU backward into a
reduction that recomputes the GeLU backward (0.30 ms) beside the kernel that writes the input
gradient (0.28 ms), where `rows` and `addmm` store the gradient and sum it (0.06 ms):
docs/performance.md, "Fourth run". `--kernels` (CUDA) lists each way's longest kernels other
than the GEMMs, which is what tells the three apart.

    python tools/bench_mlp_chain.py [--device cuda] [--seq S --batch B --hidden H]
        [--dtype bf16|fp32] [--rounds 7] [--no-compile] [--kernels] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

if __package__:      # python -m tools.bench_mlp_chain
    from . import harness
else:                # python tools/bench_mlp_chain.py (tools/harness.py says why)
    import harness


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_pass_arguments(parser, dtype_help="default: CUDA bf16, CPU fp32")
    parser.add_argument("--seq", type=int, help="s (default: CUDA 2048, CPU 128)")
    parser.add_argument("--batch", type=int, help="b (default: CUDA 8, CPU 4)")
    parser.add_argument("--hidden", type=int, help="h; the MLP is 4h wide (default: CUDA 2048, "
                                                   "CPU 256)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile each way (default on: the kernels are the point)")
    parser.add_argument("--kernels", action="store_true",
                        help="CUDA: profile one pass of each way and list its longest kernels "
                             "other than the GEMMs")
    args = parser.parse_args(argv)
    harness.check_pass_arguments(parser, args, ("seq", "batch", "hidden"))
    cuda = args.device == "cuda"
    if args.kernels and not cuda:
        parser.error("--kernels needs --device cuda (the kernels are CUDA's)")
    args.seq = args.seq or (2048 if cuda else 128)
    args.batch = args.batch or (8 if cuda else 4)
    args.hidden = args.hidden or (2048 if cuda else 256)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    return args


def mlp_ways() -> dict:
    """name -> f(x, w1, b1, w2, b2) = x + fc2(GeLU(fc1(x))), biases added three ways."""
    from ptdp.models.transformer import residual_mlp_on_rows
    from ptdp.kernels import bias_dropout_add, bias_gelu
    from ptdp.parallel.mappings import TensorParallel

    def sbh(x, w1, b1, w2, b2):
        return bias_dropout_add(F.linear(bias_gelu(F.linear(x, w1), b1), w2), b2, x, 0.0, True)

    def rows(x, w1, b1, w2, b2):   # the layer's own code (models/transformer.py)
        return residual_mlp_on_rows(lambda r: (F.linear(bias_gelu(F.linear(r, w1), b1), w2), b2),
                                    x, 0.0, True, TensorParallel())

    def addmm(x, w1, b1, w2, b2):
        return x + F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)

    return {"rows": rows, "sbh": sbh, "addmm": addmm}


def longest_kernels(pass_, top: int = 4) -> list[tuple[str, float]]:
    """(name, ms) of the `top` longest CUDA kernels of one call of `pass_`, GEMMs left out."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pass_().backward()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"
               and not any(g in e.key for g in ("gemm", "nvjet", "cutlass", "sm90_xmma"))]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    return [(e.key, e.self_device_time_total / 1e3) for e in kernels[:top]]


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), harness.pass_dtype(args.dtype)
    s, b, h = args.seq, args.batch, args.hidden
    g = torch.Generator(device=device).manual_seed(0)

    def draw(*shape, std=0.02):
        return (torch.randn(*shape, device=device, generator=g, dtype=dtype) * std).requires_grad_()

    x = draw(s, b, h, std=1.0)
    weights = [draw(4 * h, h), draw(4 * h), draw(h, 4 * h), draw(h)]
    probe = torch.randn(s, b, h, device=device, generator=g, dtype=dtype)
    ways = {name: torch.compile(f) if args.compile else f for name, f in mlp_ways().items()}

    def pass_of(name):   # the layer's input is a leaf here, as a stage's input is
        return lambda: (ways[name](x, *weights).float() * probe).mean()

    def zero_grads():
        for t in (x, *weights):
            t.grad = None

    paths = {name: pass_of(name) for name in ways}
    median, peaks, losses = harness.loss_passes(paths, zero_grads, device, args.rounds,
                                                args.warmup)
    kernels = {name: longest_kernels(paths[name]) for name in ways} if args.kernels else {}
    result = {"shape": {"seq": s, "batch": b, "hidden": h}, "dtype": args.dtype,
              "compile": args.compile, "rounds": args.rounds,
              "ms": {name: median[name] * 1e3 for name in ways},
              "over_rows": {name: median[name] / median["rows"] for name in ways},
              "rows_over_sbh": median["rows"] / median["sbh"],   # the GPU check's figure
              "peak_gb": peaks or None, "loss": losses,
              "kernels": {name: [{"name": k, "ms": ms} for k, ms in ks]
                          for name, ks in kernels.items()} or None}
    print(f"GeLU MLP forward + backward, s {s}, b {b}, h {h}, {args.dtype}, {device}, "
          f"compile {'on' if args.compile else 'off'}: median of {args.rounds} alternating rounds")
    lines = [(name, f"{median[name] * 1e3:.3f}", f"{result['over_rows'][name]:.3f}",
              f"{losses[name]:.6f}") for name in ways]
    print(harness.table(("biases", "ms", "/ rows", "loss"), lines, align="<"))
    for name, ks in kernels.items():
        print(f"{name}: " + "; ".join(f"{k[:48]} {ms:.3f} ms" for k, ms in ks))
    if args.json:
        harness.write_json(args.json, result, tool=__file__, argv=argv, device=device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
