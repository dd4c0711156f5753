"""Decoding that drafts with the model's own multi-token-prediction depth (models/mtp.py),
DeepSeek-V3's use of its MTP module for speculative decoding.

Depth 1 predicts, at position i, the token after next (i + 2) from the decoder's normalised
state at i and the embedding of token i + 1. Once token n is chosen, depth 1 at position
n - 1 drafts token n + 1. The next decoder forward runs both positions, n and the draft's:
its distribution after n checks the draft; if the draft is kept, the token after it comes
from the same forward, two tokens for one forward; if not, the draft's keys and values are
dropped from the cache and the token after n is chosen from the decoder's distribution.

* Greedy (temperature 0): the draft is the depth's argmax, kept when it is the decoder's
  argmax. Every token is the decoder's own greedy choice, so the output is greedy decoding's
  (the tests compare them token by token); only the number of decoder forwards changes.
* Sampling (temperature > 0, with top-k and top-p): speculative sampling (Leviathan et al.
  2023; Chen et al. 2023). The draft d is drawn from the depth's distribution q (cut as the
  decoder's), kept with probability min(1, p(d) / q(d)) under the decoder's p, and where it is
  not, the token is drawn from p - q where positive, renormalised. Each token is then
  distributed exactly as sampling from the decoder alone would draw it (a test compares the
  frequencies with the exact distribution); the draws themselves differ from generate()'s.

Depths beyond the first are not used (DeepSeek-V3 has one). The depth keeps its own key/value
cache, of the positions whose next token is decided.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from ptdp.inference.generate import (KVCache, Sampling, check_generation, hidden_cached,
                                     layer_cached, next_token, token_probabilities, vocab_logits)
from ptdp.inference.local_model import LocalModel


@dataclass
class Drafts:
    """How the drafts fared: `proposed` checked by the decoder, `accepted` kept."""
    proposed: int = 0
    accepted: int = 0


class MtpDrafter:
    """Depth 1 of the model's multi-token prediction, run position by position."""

    def __init__(self, model: LocalModel):
        if model.chunk.mtp is None:
            raise ValueError("speculative decoding drafts with the checkpoint's multi-token-"
                             "prediction depth, and this one has none (model.mtp_layers = 0)")
        self.model, self.depth, self.cache = model, model.chunk.mtp[0], KVCache(1)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, next_tokens: list[int]) -> torch.Tensor:
        """hidden: the decoder's normalised states [s, 1, h] of the positions after those this
        depth has run; next_tokens: the token decided after each -> the depth's logits
        [vocab] for the token after the last of next_tokens."""
        depth, words = self.depth, self.model.chunk.embedding.words
        embedded = words(torch.tensor([next_tokens], device=hidden.device).t())   # [s, 1, h]
        x = depth.eh_proj(torch.cat([depth.enorm(embedded), depth.hnorm(hidden)], dim=-1))
        x = layer_cached(depth.stack.layers[0], x, self.cache, 0, self.cache.length)
        return vocab_logits(self.model, depth.final_ln(x[-1:]))[0, -1]


class _Verifier:
    """Which draft the decoder keeps, and the token chosen where it does not."""

    def __init__(self, sampling: Sampling, generator: torch.Generator):
        self.sampling, self.generator = sampling, generator
        self.greedy = sampling.temperature == 0

    def propose(self, draft_logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """(the draft, its distribution q; None when greedy)."""
        if self.greedy:
            return int(draft_logits.argmax()), None
        q = token_probabilities(draft_logits, self.sampling)
        return int(torch.multinomial(q, 1, generator=self.generator)), q

    def keeps(self, draft: int, q, logits: torch.Tensor) -> tuple[bool, int | None]:
        """(is the draft kept; the token taken instead where it is not) given the decoder's
        logits after the token before the draft."""
        if self.greedy:
            guess = int(logits.argmax())
            return guess == draft, guess
        p = token_probabilities(logits, self.sampling)
        u = float(torch.rand(1, generator=self.generator))
        if u * float(q[draft]) < float(p[draft]):   # u < p(d) / q(d)
            return True, None
        rest = (p - q).clamp(min=0)   # not empty once p(d) < q(d), but for round-off
        return False, int(torch.multinomial(rest if rest.sum() > 0 else p, 1,
                                            generator=self.generator))

    def choose(self, logits: torch.Tensor) -> int:
        return next_token(logits, self.sampling, self.generator)


@torch.no_grad()
def generate_speculative(model: LocalModel, prompt: list[int], max_new_tokens: int,
                         sampling: Sampling | None = None, stop_ids: Collection[int] = (),
                         drafts: Drafts | None = None,
                         drafter: MtpDrafter | None = None) -> list[int]:
    """New tokens after `prompt`, distributed as generate()'s (greedy: the same tokens), at most
    max_new_tokens; fewer at the first of stop_ids or the model's last position. A draft is
    checked in each decoder forward (module docstring); `drafts` counts them."""
    sampling = sampling or Sampling()
    sampling.check()
    limit = check_generation(model, prompt)
    drafter = drafter or MtpDrafter(model)
    drafts = drafts if drafts is not None else Drafts()
    verify = _Verifier(sampling, torch.Generator().manual_seed(sampling.seed))
    device = next(model.parameters()).device
    cache = KVCache(model.cfg.num_layers)
    hidden = hidden_cached(model, torch.tensor([prompt], device=device), cache)
    new = [verify.choose(vocab_logits(model, hidden[-1:])[0, -1])]
    decided = prompt[1:] + new   # the next token of each position in `hidden`
    while len(new) < max_new_tokens and len(prompt) + len(new) < limit \
            and new[-1] not in stop_ids:
        # a draft only where both it and the token after it may still be added (else this
        # step, the last, adds one token as generate() does)
        drafting = len(new) + 2 <= max_new_tokens and len(prompt) + len(new) + 2 <= limit
        draft, q = verify.propose(drafter.logits(hidden, decided)) if drafting else (None, None)
        feed = [new[-1], draft] if drafting else [new[-1]]
        hidden = hidden_cached(model, torch.tensor([feed], device=device), cache)
        logits = vocab_logits(model, hidden)[0]
        kept, instead = verify.keeps(draft, q, logits[0]) if drafting else (False, None)
        drafts.proposed += drafting
        drafts.accepted += kept
        if kept:
            decided = [draft] if draft in stop_ids else [draft, verify.choose(logits[1])]
        else:
            if drafting:   # the draft's position leaves the cache
                cache.truncate(cache.length - 1)
            decided = [instead if drafting else verify.choose(logits[0])]
        hidden = hidden[:len(decided)]
        new += decided
    return new
