"""Greedy decoding that drafts with the model's own multi-token-prediction depth (models/mtp.py),
DeepSeek-V3's use of its MTP module for speculative decoding.

Depth 1 predicts, at position i, the token after next (i + 2) from the decoder's normalised
state at i and the embedding of token i + 1. Once the decoder has chosen token n (greedy),
depth 1 at position n - 1 drafts token n + 1. The next decoder forward runs both positions,
n and the draft's: its guess after n checks the draft; if they agree, the draft is kept and
the guess after the draft comes free, two tokens for one forward; if not, the draft's keys
and values are dropped from the cache and the guess after n is taken. Every token kept is
the decoder's own greedy choice, so the output is greedy decoding's (the tests compare them
token by token); only the number of decoder forwards changes. Depths beyond the first are
not used (DeepSeek-V3 has one).

The depth keeps its own key/value cache, of the positions whose next token is decided.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from ptdp.inference.generate import (KVCache, check_generation, hidden_cached, layer_cached,
                                     vocab_logits)
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
    def draft(self, hidden: torch.Tensor, next_tokens: list[int]) -> int:
        """hidden: the decoder's normalised states [s, 1, h] of the positions after those this
        depth has run; next_tokens: the token decided after each -> the greedy guess for
        the token after the last of next_tokens."""
        depth, words = self.depth, self.model.chunk.embedding.words
        embedded = words(torch.tensor([next_tokens], device=hidden.device).t())   # [s, 1, h]
        x = depth.eh_proj(torch.cat([depth.enorm(embedded), depth.hnorm(hidden)], dim=-1))
        x = layer_cached(depth.stack.layers[0], x, self.cache, 0, self.cache.length)
        return int(vocab_logits(self.model, depth.final_ln(x[-1:]))[0, -1].argmax())


@torch.no_grad()
def generate_speculative(model: LocalModel, prompt: list[int], max_new_tokens: int,
                         stop_ids: Collection[int] = (), drafts: Drafts | None = None,
                         drafter: MtpDrafter | None = None) -> list[int]:
    """generate()'s greedy output (at most max_new_tokens; fewer at the first of stop_ids or
    the model's last position), with a draft checked in each decoder forward (module
    docstring). `drafts` counts them."""
    limit = check_generation(model, prompt)
    drafter = drafter or MtpDrafter(model)
    drafts = drafts if drafts is not None else Drafts()
    device = next(model.parameters()).device
    cache = KVCache(model.cfg.num_layers)
    hidden = hidden_cached(model, torch.tensor([prompt], device=device), cache)
    new = [int(vocab_logits(model, hidden[-1:])[0, -1].argmax())]
    decided = prompt[1:] + new   # the next token of each position in `hidden`
    while len(new) < max_new_tokens and len(prompt) + len(new) < limit \
            and new[-1] not in stop_ids:
        draft = drafter.draft(hidden, decided)
        # the draft is checked when both it and the token after it may still be added
        checked = len(new) + 2 <= max_new_tokens and len(prompt) + len(new) + 2 <= limit
        feed = [new[-1], draft] if checked else [new[-1]]
        hidden = hidden_cached(model, torch.tensor([feed], device=device), cache)
        guesses = vocab_logits(model, hidden)[0].argmax(-1).tolist()
        drafts.proposed += checked
        if checked and guesses[0] == draft:
            drafts.accepted += 1
            decided = [draft] if draft in stop_ids else [draft, guesses[1]]
        else:
            if checked:   # the draft's position leaves the cache
                cache.truncate(cache.length - 1)
            decided = guesses[:1]
        hidden = hidden[:len(decided)]
        new += decided
    return new
