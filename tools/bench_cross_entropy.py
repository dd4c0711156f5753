"""Benchmark (not a test): the loss's two paths, eager and fused (ptdp/parallel/cross_entropy.py).

Times forward + backward of `vocab_parallel_cross_entropy` on one rank (t = 1) over logits
[s, b, V], eager (passes over one fp32 copy of the logits) against fused (train.compile: one
compiled kernel per pass over the logits as they are), in alternating rounds after a warm-up
that compiles, and reports the median of each, their ratio and, on CUDA, the peak memory each
adds above the logits. The default shape is GPT-1.3B's loss at bench_gpu.py's micro-batch on
CUDA (s 2048, b 8, V 51,200, bf16: what one H200 profiled at about 50 ms of a 1.09 s step,
docs/performance.md) and a smaller one on CPU.

    python tools/bench_cross_entropy.py [--device cuda] [--seq S --batch B --vocab V]
        [--dtype bf16|fp32] [--rounds 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys

import torch

if __package__:      # python -m tools.bench_cross_entropy
    from . import harness
else:                # python tools/bench_cross_entropy.py (tools/harness.py says why)
    import harness


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_pass_arguments(parser, dtype_help="default bf16")
    parser.add_argument("--seq", type=int, help="s (default: CUDA 2048, CPU 256)")
    parser.add_argument("--batch", type=int, help="b (default: CUDA 8, CPU 4)")
    parser.add_argument("--vocab", type=int, default=51200, help="V, padded (default 51,200)")
    args = parser.parse_args(argv)
    harness.check_pass_arguments(parser, args, ("seq", "batch", "vocab"))
    cuda = args.device == "cuda"
    args.seq = args.seq or (2048 if cuda else 256)
    args.dtype = args.dtype or "bf16"
    args.batch = args.batch or (8 if cuda else 4)
    return args


def main(argv=None) -> int:
    from ptdp.parallel.cross_entropy import vocab_parallel_cross_entropy
    from ptdp.parallel.mappings import TensorParallel
    args = parse_args(argv)
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(args.seq, args.batch, args.vocab, device=device, generator=g,
                         dtype=harness.pass_dtype(args.dtype)).requires_grad_()
    target = torch.randint(0, args.vocab, (args.seq, args.batch), device=device, generator=g)

    def loss(fused: bool):
        return lambda: vocab_parallel_cross_entropy(logits, target, args.vocab, TensorParallel(),
                                                    fused=fused).mean()

    def zero_grads():
        logits.grad = None

    median, peaks, losses = harness.loss_passes({"eager": loss(False), "fused": loss(True)},
                                                zero_grads, device, args.rounds, args.warmup)
    result = {"shape": {"seq": args.seq, "batch": args.batch, "vocab": args.vocab},
              "dtype": args.dtype, "rounds": args.rounds,
              "eager_ms": median["eager"] * 1e3, "fused_ms": median["fused"] * 1e3,
              "fused_over_eager": median["fused"] / median["eager"],
              "peak_gb": peaks or None, "loss": losses}
    print(f"cross-entropy forward + backward, s {args.seq}, b {args.batch}, V {args.vocab}, "
          f"{args.dtype}, {device}: median of {args.rounds} alternating rounds")
    rows = [(name, f"{median[name] * 1e3:.2f}",
             f"{peaks[name]:.2f}" if name in peaks else "n/a", f"{losses[name]:.6f}")
            for name in ("eager", "fused")]
    print(harness.table(("path", "ms", "peak GiB above the logits", "loss"), rows, align="<"))
    print(f"fused / eager: {result['fused_over_eager']:.3f}x time")
    if args.json:
        harness.write_json(args.json, result, tool=__file__, argv=argv, device=device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
