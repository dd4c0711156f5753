"""Benchmark (not a test): BERT's heads on the masked positions against every token.

BERT's heads as ptdp runs them, on the masked positions (models/bert.py), against the same
heads over every token (as Hugging Face's BertForPreTraining and Megatron's BERT run them).

Times forward + backward of the masked-LM head (dense, GeLU, LayerNorm, tied logits, the
vocabulary-parallel loss) and the sentence-order head on one rank (t = 1), from the last
layer's output to its gradient, in alternating rounds after a warm-up, and reports the median
of each, their ratio and, on CUDA, the peak memory each adds. The masked positions are drawn
at `--masked` of the tokens (BERT's 15 %) and listed on the host, as the data pipeline lists
them (ptdp/data/batching.py `loss_rows`). The default shape is BERT-large's at bench_gpu.py's
micro-batch on CUDA (s 512, b 16, h 1,024, V 30,522, bf16) and one of the same head share on
CPU (s 128, b 4, h 256, V 7,680, fp32: the head is about 9 % of a 24-layer model's FLOPs at
both).

    python tools/bench_bert_head.py [--device cuda] [--seq S --batch B --hidden H --vocab V]
        [--masked 0.15] [--dtype bf16|fp32] [--rounds 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

if __package__:      # python -m tools.bench_bert_head
    from . import harness
else:                # python tools/bench_bert_head.py (tools/harness.py says why)
    import harness


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_pass_arguments(parser, dtype_help="default: CUDA bf16, CPU fp32")
    parser.add_argument("--seq", type=int, help="s (default: CUDA 512, CPU 128)")
    parser.add_argument("--batch", type=int, help="b (default: CUDA 16, CPU 4)")
    parser.add_argument("--hidden", type=int, help="h (default: CUDA 1,024, CPU 256)")
    parser.add_argument("--vocab", type=int, help="V (default: CUDA 30,522, CPU 7,680)")
    parser.add_argument("--masked", type=float, default=0.15, help="share of masked tokens")
    args = parser.parse_args(argv)
    harness.check_pass_arguments(parser, args, ("seq", "batch", "hidden", "vocab"))
    if not 0 < args.masked <= 1:
        parser.error("--masked must be in (0, 1]")
    cuda = args.device == "cuda"
    args.seq = args.seq or (512 if cuda else 128)
    args.batch = args.batch or (16 if cuda else 4)
    args.hidden = args.hidden or (1024 if cuda else 256)
    args.vocab = args.vocab or (30522 if cuda else 7680)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    return args


def _heads(args, device):
    """BERT's heads and a word table of the model's shape, and one micro-batch's labels."""
    from ptdp.config import ModelConfig
    from ptdp.config.schema import padded_vocab_size
    from ptdp.data.batching import loss_rows
    from ptdp.models.bert import BertHeads
    from ptdp.models.transformer import ModelContext
    from ptdp.parallel.mappings import TensorParallel
    from ptdp.parallel.rng import TensorParallelRNG
    heads_of_width = max(1, args.hidden // 64)
    cfg = ModelConfig(arch="bert", num_layers=1, hidden_size=args.hidden,
                      num_heads=heads_of_width, seq_length=args.seq, vocab_size=args.vocab,
                      dropout=0.0)
    padded = padded_vocab_size(args.vocab, 1)
    ctx = ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, device), padded)
    dtype = harness.pass_dtype(args.dtype)
    heads = BertHeads(ctx).to(device, dtype)
    g = torch.Generator().manual_seed(0)
    table = (torch.randn(padded, args.hidden, generator=g) * 0.02).to(device, dtype)
    table.requires_grad_()
    mask = (torch.rand(args.batch, args.seq, generator=g) < args.masked).float()
    batch = {"loss_mask": mask, "loss_rows": loss_rows(mask),
             "labels": torch.randint(0, args.vocab, (args.batch, args.seq), generator=g),
             "sop_label": torch.randint(0, 2, (args.batch,), generator=g)}
    batch = {key: value.to(device) for key, value in batch.items()}
    return heads, table, batch


def _every_token(heads, hidden, table, batch):
    """The heads as Hugging Face and Megatron run them: the masked-LM head over all s * b
    tokens, the loss weighted by the mask (what models/bert.py computed before)."""
    from ptdp.models.embedding import logits
    from ptdp.parallel.cross_entropy import vocab_parallel_cross_entropy
    lm = heads.lm_ln(F.gelu(heads.lm_dense(hidden)))
    per_token = vocab_parallel_cross_entropy(
        logits(lm, table, heads.ctx, heads.lm_bias, ops=heads.weight_ops), batch["labels"].t(),
        heads.ctx.model.vocab_size, heads.ctx.tp, fused=heads.ctx.compile)
    mask = batch["loss_mask"].t().to(per_token.dtype)
    lm_loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    pooled = torch.tanh(heads.pooler(hidden[0]))
    return lm_loss + F.cross_entropy(heads.binary(pooled).float(), batch["sop_label"].view(-1))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    heads, table, batch = _heads(args, device)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(args.seq, args.batch, args.hidden, generator=g).to(
        device, harness.pass_dtype(args.dtype)).requires_grad_()
    paths = {"masked rows": lambda: heads(hidden, table, batch)[0],
             "every token": lambda: _every_token(heads, hidden, table, batch)}

    def zero_grads():
        hidden.grad = table.grad = None
        heads.zero_grad(set_to_none=True)

    median, peaks, losses = harness.loss_passes(paths, zero_grads, device, args.rounds,
                                                args.warmup)
    ratio = median["masked rows"] / median["every token"]
    result = {"shape": {"seq": args.seq, "batch": args.batch, "hidden": args.hidden,
                        "vocab": args.vocab, "masked": args.masked},
              "dtype": args.dtype, "rounds": args.rounds,
              "masked_rows": int(batch["loss_mask"].sum()),
              "head_rows": int(batch["loss_rows"].numel()),   # rounded up (loss_rows)
              "ms": {name: median[name] * 1e3 for name in paths},
              "masked_over_every_token": ratio, "peak_gb": peaks or None, "loss": losses}
    print(f"BERT heads forward + backward, s {args.seq}, b {args.batch}, h {args.hidden}, "
          f"V {args.vocab}, {result['masked_rows']} masked tokens ({result['head_rows']} rows "
          f"with the rounding), {args.dtype}, {device}: "
          f"median of {args.rounds} alternating rounds")
    rows = [(name, f"{median[name] * 1e3:.2f}",
             f"{peaks[name]:.3f}" if name in peaks else "n/a", f"{losses[name]:.6f}")
            for name in paths]
    print(harness.table(("head on", "ms", "peak GiB added", "loss"), rows, align="<"))
    print(f"masked rows / every token: {ratio:.3f}x time")
    if args.json:
        harness.write_json(args.json, result, tool=__file__, argv=argv, device=device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
