"""Benchmark (not a test): SDPA's kernels for GPT's causal attention, each pinned in turn.

ptdp's GPT and Llama layers, and the plain references of tools/bench_gpu.py, call
`F.scaled_dot_product_attention(q, k, v, is_causal=True)` and let torch pick the kernel (on one
H200 with torch 2.11, cuDNN's; its backward took 96 ms of GPT-1.3B's 1.05 s step, its forward
29 ms: docs/performance.md). This tool measures whether pinning another kernel would gain,
before any layer does it: forward + backward of that call as torch picks it (`default`) and
with each backend pinned (`torch.nn.attention.sdpa_kernel`: flash, cuDNN, memory-efficient; the
ones that refuse the shape or device are listed as unavailable), in alternating rounds, each
one's median time over the default's, and each one's largest error in the output and the three
input gradients against the math kernel in fp32 on the same inputs. The default shape is
GPT-1.3B's at bench_gpu.py's micro-batch on CUDA (b 8, 16 heads, s 2048, head 128, bf16) and a
small one on CPU, where only flash and math run.

    python tools/bench_attention_backends.py [--device cuda] [--batch B --heads H --seq S
        --head-dim D] [--dtype bf16|fp32] [--rounds 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

if __package__:      # python -m tools.bench_attention_backends
    from . import harness
else:                # python tools/bench_attention_backends.py (tools/harness.py says why)
    import harness

CANDIDATES = ("default", "flash", "cudnn", "efficient")   # the baseline first: torch's pick
BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
            "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_pass_arguments(parser, dtype_help="default bf16")
    parser.add_argument("--batch", type=int, help="b (default: CUDA 8, CPU 2)")
    parser.add_argument("--heads", type=int, help="attention heads (default: CUDA 16, CPU 4)")
    parser.add_argument("--seq", type=int, help="s (default: CUDA 2048, CPU 256)")
    parser.add_argument("--head-dim", type=int, help="head size (default: CUDA 128, CPU 32)")
    args = parser.parse_args(argv)
    harness.check_pass_arguments(parser, args, ("batch", "heads", "seq", "head_dim"))
    cuda = args.device == "cuda"
    args.batch = args.batch or (8 if cuda else 2)
    args.heads = args.heads or (16 if cuda else 4)
    args.seq = args.seq or (2048 if cuda else 256)
    args.head_dim = args.head_dim or (128 if cuda else 32)
    args.dtype = args.dtype or "bf16"
    return args


def attention(backend: str, q, k, v):
    """Causal SDPA with only `backend`'s kernel allowed (torch raises if it refuses), or as
    torch picks it for `default`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if backend == "default":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel([getattr(SDPBackend, BACKENDS[backend])]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def output_and_grads(backend: str, q, k, v, weight) -> list[torch.Tensor]:
    """Attention's output and the gradients of q, k, v for the loss sum(out * weight)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attention(backend, *leaves)
    (out.float() * weight).sum().backward()
    return [out.detach().float()] + [t.grad.float() for t in leaves]


def available(backend: str, q, k, v) -> bool:
    """Whether torch runs `backend` on inputs like q, k, v (forward and backward)."""
    try:
        small = [t[:1, :1].detach().clone().requires_grad_() for t in (q, k, v)]
        attention(backend, *small).sum().backward()
        return True
    except RuntimeError:   # "No available kernel", or a device without it
        return False


def errors(q, k, v, weight, backends) -> dict:
    """Each backend's largest absolute error in out, dq, dk, dv against fp32 math."""
    reference = output_and_grads("math", q.float(), k.float(), v.float(), weight)
    result = {}
    for name in backends:
        got = output_and_grads(name, q, k, v, weight)
        result[name] = {part: (a - b).abs().max().item()
                        for part, a, b in zip(("out", "dq", "dk", "dv"), got, reference)}
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, generator=g, dtype=harness.pass_dtype(args.dtype))
               .requires_grad_() for _ in range(3))
    weight = torch.randn(shape, device=device, generator=g)
    backends = [name for name in CANDIDATES if available(name, q, k, v)]

    def passes(name):
        return lambda: (attention(name, q, k, v).float() * weight).sum()

    def zero_grads():
        for t in (q, k, v):
            t.grad = None

    median, peaks, _ = harness.loss_passes({name: passes(name) for name in backends}, zero_grads,
                                           device, args.rounds, args.warmup)
    error = errors(q, k, v, weight, backends)
    result = {"shape": {"batch": args.batch, "heads": args.heads, "seq": args.seq,
                        "head_dim": args.head_dim, "causal": True},
              "dtype": args.dtype, "rounds": args.rounds,
              "unavailable": [name for name in CANDIDATES if name not in backends],
              "ms": {name: median[name] * 1e3 for name in backends},
              "over_default": {name: median[name] / median["default"] for name in backends},
              "best_over_default": min(median.values()) / median["default"],
              "peak_gb": peaks or None, "max_error_vs_fp32_math": error}
    print(f"causal attention forward + backward, b {args.batch}, {args.heads} heads, s {args.seq}, "
          f"head {args.head_dim}, {args.dtype}, {device}: median of {args.rounds} alternating "
          f"rounds; errors against the math kernel in fp32")
    rows = [(name, f"{median[name] * 1e3:.3f}", f"{result['over_default'][name]:.3f}",
             *(f"{error[name][part]:.2e}" for part in ("out", "dq", "dk", "dv")))
            for name in backends]
    print(harness.table(("kernel", "ms", "/ default", "out err", "dq err", "dk err", "dv err"),
                        rows, align="<"))
    if result["unavailable"]:
        print(f"not available here: {', '.join(result['unavailable'])}")
    print(f"fastest / default: {result['best_over_default']:.3f}x time")
    if args.json:
        harness.write_json(args.json, result, tool=__file__, argv=argv, device=device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
