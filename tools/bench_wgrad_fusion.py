"""Benchmark (not a test): weight gradients into fp32 `main_grad`, added after the GEMM or by it.

With bf16 weights ptdp computes each linear's weight gradient as a bf16 GEMM, and a hook adds
it into the parameter's fp32 `main_grad` (ptdp/optim/mixed_precision.py): one more pass over
the gradient per linear and micro-batch, on a mixed-dtype add that one H200 profiled at about
25 ms of GPT-1.3B's 1.05 s step (docs/performance.md). Megatron-LM's gradient-accumulation
fusion lets the GEMM accumulate into `main_grad` itself; in torch that is `addmm` with an fp32
`out_dtype` writing into `main_grad` (CUDA only). This tool measures what that would gain
before any layer does it, over GPT-1.3B's four linears of one layer (QKV, projection, fc1,
fc2) at bench_gpu.py's micro-batch (tokens = s * b = 16,384, h 2,048, bf16):

* `add`:   the bf16 GEMM, then `main_grad.add_(grad)` (what ptdp does);
* `fused`: `addmm(main_grad, dY^T, X, out_dtype=fp32, out=main_grad)` (on CPU, where torch has
  no `out_dtype` GEMM, the same accumulation through an fp32 GEMM, to show the tool runs);

each in alternating rounds, the fused path's median over the add's, and each path's largest
error in `main_grad` against fp64 (the fused path skips the bf16 rounding of the gradient).

    python tools/bench_wgrad_fusion.py [--device cuda] [--tokens N --hidden H]
        [--rounds 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

if __package__:      # python -m tools.bench_wgrad_fusion
    from . import harness
else:                # python tools/bench_wgrad_fusion.py (tools/harness.py says why)
    import harness


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tokens", type=int, help="s * b (default: CUDA 16,384, CPU 512)")
    parser.add_argument("--hidden", type=int, help="h (default: CUDA 2,048, CPU 128)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)   # the pass tools' checks; no --dtype: the GEMMs are bf16
    harness.check_pass_arguments(parser, args, ("tokens", "hidden"))
    cuda = args.device == "cuda"
    args.tokens = args.tokens or (16384 if cuda else 512)
    args.hidden = args.hidden or (2048 if cuda else 128)
    return args


def linears(h: int) -> dict:
    """GPT's linears of one layer: name -> (out features, in features)."""
    return {"qkv": (3 * h, h), "proj": (h, h), "fc1": (4 * h, h), "fc2": (h, 4 * h)}


def accumulate_add(main_grad, grad_out, inputs):
    main_grad.add_(grad_out.t() @ inputs)   # a bf16 gradient, then a mixed-dtype add


def accumulate_fused(main_grad, grad_out, inputs):
    if main_grad.is_cuda:
        torch.ops.aten.addmm.dtype_out(main_grad, grad_out.t(), inputs, torch.float32,
                                       out=main_grad)
    else:   # torch has no out_dtype GEMM on CPU: the same sum through an fp32 GEMM
        main_grad.addmm_(grad_out.t().float(), inputs.float())


PATHS = {"add": accumulate_add, "fused": accumulate_fused}


def fused_problem(device) -> str | None:
    """Why `accumulate_fused` fails on `device` (one line), or None when it runs."""
    main_grad = torch.zeros(8, 4, device=device)
    try:
        accumulate_fused(main_grad, torch.ones(2, 8, device=device).bfloat16(),
                         torch.ones(2, 4, device=device).bfloat16())
    except (RuntimeError, NotImplementedError) as error:
        return str(error).splitlines()[0]
    return None if torch.equal(main_grad, torch.full((8, 4), 2.0, device=device)) else \
        "it accumulated a wrong sum into main_grad"


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    shapes = linears(args.hidden)
    data = {name: (torch.randn(args.tokens, out, device=device, generator=g).bfloat16(),
                   torch.randn(args.tokens, inp, device=device, generator=g).bfloat16())
            for name, (out, inp) in shapes.items()}
    grads = {path: {name: torch.zeros(shape, device=device) for name, shape in shapes.items()}
             for path in PATHS}

    problem = fused_problem(device)
    if problem is not None:   # a torch without the out_dtype GEMM: say so, time nothing
        print(f"the fused path does not run here: {problem}", file=sys.stderr)
        if args.json:
            harness.write_json(args.json, {"fused_over_add": None, "fused_problem": problem},
                               tool=__file__, argv=argv, device=device)
        return 2

    def side(path):
        def step(_):
            for name, (grad_out, inputs) in data.items():
                PATHS[path](grads[path][name], grad_out, inputs)
            if device.type == "cuda":
                torch.cuda.synchronize()   # the host's clock then times the kernels too
        return step

    timed = harness.alternating({path: side(path) for path in PATHS}, args.rounds,
                                warmup=args.warmup, swap=True)
    median = {path: statistics.median(r[path].wall for r in timed) for path in PATHS}
    calls = args.warmup + args.rounds   # each main_grad holds this many sums of one product
    error = {path: max((grads[path][name].double() - calls * (
                        data[name][0].double().t() @ data[name][1].double())).abs().max().item()
                       for name in shapes)
             for path in PATHS}
    result = {"shape": {"tokens": args.tokens, "hidden": args.hidden,
                        "linears": {name: list(shape) for name, shape in shapes.items()}},
              "rounds": args.rounds, "ms": {path: median[path] * 1e3 for path in PATHS},
              "fused_over_add": median["fused"] / median["add"],
              "max_error_vs_fp64": error,
              "fused_kernel": "addmm.dtype_out" if device.type == "cuda" else "fp32 addmm (CPU)"}
    print(f"weight gradients of GPT's four linears into fp32 main_grad, {args.tokens} tokens, "
          f"h {args.hidden}, bf16, {device}: median of {args.rounds} alternating rounds")
    rows = [(path, f"{median[path] * 1e3:.3f}", f"{error[path]:.3e}") for path in PATHS]
    print(harness.table(("path", "ms", "max error vs fp64"), rows, align="<"))
    print(f"fused / add: {result['fused_over_add']:.3f}x time")
    if args.json:
        harness.write_json(args.json, result, tool=__file__, argv=argv, device=device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
