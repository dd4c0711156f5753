"""Benchmark (not a test): `ptdp generate --speculative` against plain decoding (greedy, or
sampled with --temperature), in the same run, on a model that has learned something.

A small Llama-style model with one multi-token-prediction depth (model.mtp_layers = 1) is
trained on ptdp's synthetic data (arithmetic sequences mod V with a random start and stride:
ptdp/data/synthetic.py) for --iters iterations on one rank; then both decoders continue the
same prompts (each the first --prompt-tokens of a held-out sample) with the key/value cache,
their calls alternating per round (--temperature > 0: both sample, seeded). Reported: whether
the tokens are the same (greedy: they must be; sampled, speculative sampling keeps the
distribution, not the draws), the share of drafts kept, decoder forwards per new token, and
the median seconds per round of each with their ratio.

    python tools/bench_speculative.py --iters 300 --out bench/speculative
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__:      # python -m tools.bench_speculative, or imported by a test
    from . import harness
else:                # python tools/bench_speculative.py (tools/harness.py says why)
    import harness


def overrides(args) -> list[str]:
    return [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
            f"model.num_heads={args.heads}", "model.preset=llama", "model.num_kv_heads=2",
            f"model.ffn_hidden_size={4 * args.hidden}", f"model.seq_length={args.seq}",
            f"model.vocab_size={args.vocab}", "model.dropout=0.0", "model.mtp_layers=1",
            f"train.iters={args.iters}", "train.micro_batch_size=8",
            "train.global_batch_size=8", "train.lr=3e-3", "train.lr_warmup_iters=20",
            "train.device=cpu", "log.progress=false", f"train.seed={args.seed}"]


def trained_state(args) -> tuple[dict, float]:
    """The trained model's full weights and its last loss, trained on one rank here."""
    from ptdp.config import load_config
    from ptdp.training import Trainer
    with harness.world_of_one():
        trainer = Trainer(load_config(None, overrides(args)))
        records = trainer.train()
        return trainer.full_state(), records[-1]["loss"]


def prompts(args, cfg) -> list[list[int]]:
    """The first --prompt-tokens of held-out synthetic samples (indices the training never
    reached)."""
    from ptdp.data.synthetic import SyntheticGPT
    data = SyntheticGPT(cfg, args.seed + 1)
    return [data[i]["tokens"][:args.prompt_tokens].tolist() for i in range(args.prompts)]


def measure(args) -> dict:
    from ptdp.config import load_config
    from ptdp.inference.generate import Sampling, generate
    from ptdp.inference.local_model import LocalModel
    from ptdp.inference.speculative import Drafts, generate_speculative
    import torch
    torch.set_num_threads(args.threads)
    state, loss = trained_state(args)
    cfg = load_config(None, overrides(args)).model
    model = LocalModel(cfg, state)
    cases = prompts(args, cfg)
    drafts = Drafts()
    sampling = lambda n: Sampling(args.temperature, seed=n)   # noqa: E731  (0: greedy)
    sides = {"plain": lambda i: [generate(model, p, args.new_tokens, sampling(n))
                                  for n, p in enumerate(cases)],
             "speculative": lambda i: [generate_speculative(model, p, args.new_tokens,
                                                            sampling(n), drafts=drafts)
                                       for n, p in enumerate(cases)]}
    rounds = harness.alternating(sides, args.rounds, warmup=1, swap=True)
    plain, fast = rounds[0]["plain"].result, rounds[0]["speculative"].result
    new = sum(len(out) for out in fast)
    runs = args.rounds + 1   # the warm-up round counted its drafts too
    seconds = {name: statistics.median(r[name].wall for r in rounds) for name in sides}
    ratios = [r["plain"].wall / r["speculative"].wall for r in rounds]
    return {"final_training_loss": loss, "same_tokens": plain == fast, "prompts": len(cases),
            "new_tokens": new, "drafts_proposed": drafts.proposed // runs,
            "drafts_kept": drafts.accepted // runs,
            "decoder_forwards_per_token": {
                "plain": 1.0, "speculative": (new - drafts.accepted // runs) / new},
            "seconds": seconds, "speedup_median": statistics.median(ratios),
            "speedup_range": [min(ratios), max(ratios)]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--iters", type=int, default=300, help="training iterations")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (the tokens must match); > 0: both decoders sample")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default="bench/speculative", help="folder for result.json")
    args = parser.parse_args(argv)
    if args.prompt_tokens + args.new_tokens > args.seq:
        parser.error("--prompt-tokens + --new-tokens must fit in --seq")
    out = measure(args)
    forwards = out["decoder_forwards_per_token"]
    print(f"{args.layers} layers, h {args.hidden}, V {args.vocab}, {args.iters} iterations "
          f"(final loss {out['final_training_loss']:.3f}); {out['prompts']} prompts of "
          f"{args.prompt_tokens} tokens, {args.new_tokens} new each; same tokens: "
          f"{out['same_tokens']}; drafts kept {out['drafts_kept']} of {out['drafts_proposed']}")
    print(harness.table(["decoder", "s per round (median)", "forwards per token"], [
        [name, f"{out['seconds'][name]:.3f}", f"{forwards[name]:.2f}"]
        for name in ("plain", "speculative")]))
    low, high = out["speedup_range"]
    print(f"speculative speedup (plain s / speculative s, {args.rounds} rounds): median "
          f"{out['speedup_median']:.2f}x, range {low:.2f}-{high:.2f}x")
    path = harness.write_json(Path(args.out) / "result.json", {"args": vars(args), **out},
                              tool=__file__, argv=argv)
    print(f"wrote {path}")
    return 0 if out["same_tokens"] or args.temperature > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
