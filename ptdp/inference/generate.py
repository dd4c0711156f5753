"""Text generation from a GPT checkpoint of any layout, in one process (CPU or GPU).

The model is `LocalModel` (ptdp/inference/local_model.py) (the training code's own modules, full weights).
Decoding keeps a key/value cache: the prompt runs once, then each new token runs one
position through every layer, attending to the cached keys and values of all earlier
positions. `use_cache=False` recomputes the whole sequence with the model's training forward
at every step instead (the reference the tests compare the cache against).

Sampling: temperature 0 is greedy (argmax); otherwise logits / temperature, then top-k (keep
the k largest), then top-p (keep the smallest set of tokens whose probability reaches p),
then one draw from a `torch.Generator` seeded with `seed`, so a seed fixes the sample.
Prompt + new tokens stop at the model's last position: model.seq_length for learned
positions (the table's length); for rotary ones model.max_position_embeddings when the
checkpoint records it (a model converted from Hugging Face), else model.seq_length.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from ptdp.config.models import family_names
from ptdp.inference.local_model import LocalModel
from ptdp.kernels import bias_dropout_add
from ptdp.models.attention import attention, decoding_mask


@dataclass
class Sampling:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = no top-k cut
    top_p: float = 1.0         # 1 = no nucleus cut
    seed: int = 1234

    def check(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token id from a [vocab] row of logits."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(token_probabilities(logits, sampling), 1, generator=generator))


def token_probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution [vocab] (fp32, on the CPU) a temperature > 0 draws from: the logits
    over the temperature, cut by top-k and top-p."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the first stays)
        drop = probs.cumsum(-1) - probs >= sampling.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits.softmax(-1).cpu()


class KVCache:
    """Per layer, the keys and values [b, kv_heads, s, d] of every position run so far (with
    grouped-query attention, one per group of query heads: num_heads / num_kv_heads times
    smaller than the queries')."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (a refused draft's:
        ptdp/inference/speculative.py)."""
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]


def layer_cached(layer, x: torch.Tensor, cache: KVCache, index: int, start: int) -> torch.Tensor:
    """One transformer layer on x [s, b, h], positions start .. start + s - 1, the first
    `start` of which cache layer `index` holds; adds their keys and values to it. The layer's
    own modules (its norms, QKV projection and rotation, MLP), so the arithmetic is
    TransformerLayer.forward's."""
    s, b = x.shape[0], x.shape[1]
    positions = torch.arange(start, start + s, device=x.device)
    # query i (absolute position start + i) sees keys 0 .. start + i (within its window)
    mask = decoding_mask(start, s, layer.attention.window, x.device)
    q, k, v = layer.attention.project(layer.ln1(x), positions)
    k, v = cache.extend(index, k, v)
    out = attention(q, k, v, mask, causal=mask is None and start == 0 and s > 1,
                    scale=layer.attention.softmax_scale)
    out = out.permute(2, 0, 1, 3).reshape(s, b, -1)
    x = bias_dropout_add(*layer.attention.proj(out), x, 0.0, False)
    return bias_dropout_add(*layer.mlp(layer.ln2(x)), x, 0.0, False)


@torch.no_grad()
def hidden_cached(model: LocalModel, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The final norm's output [s, b, h] for `tokens` [b, s], the positions after those in
    `cache`, whose keys and values it adds."""
    chunk, start = model.chunk, cache.length
    emb = chunk.embedding
    x = emb.words(tokens.t())                                               # [s, b, h]
    if emb.position is not None:
        x = x + emb.position[start:start + tokens.shape[1]].unsqueeze(1)
    for i, layer in enumerate(chunk.stack.layers):
        x = layer_cached(layer, x, cache, i, start)
    return chunk.final_ln(x)


def vocab_logits(model: LocalModel, hidden: torch.Tensor) -> torch.Tensor:
    """Normalised hidden states [s, b, h] -> logits [b, s, vocab], fp32, through the model's
    output layer."""
    from ptdp.models.embedding import logits
    out = logits(hidden, model.chunk.output_table(), model.chunk.ctx)
    return out[..., :model.cfg.vocab_size].transpose(0, 1).float()


@torch.no_grad()
def forward_cached(model: LocalModel, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [b, s, vocab] of `tokens` [b, s], the positions after those in `cache`; adds their
    keys and values to it."""
    return vocab_logits(model, hidden_cached(model, tokens, cache))


@torch.no_grad()
def generate(model: LocalModel, prompt: list[int], max_new_tokens: int, sampling: Sampling,
             stop_ids: Collection[int] = (), use_cache: bool = True) -> list[int]:
    """The new token ids after `prompt` (at most max_new_tokens; fewer at the first of
    stop_ids, which is kept, as transformers keeps its eos, or at the model's last position)."""
    sampling.check()
    limit = check_generation(model, prompt)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(sampling.seed)
    tokens = list(prompt)
    cache = KVCache(model.cfg.num_layers)
    pending = tokens
    new: list[int] = []
    while len(new) < max_new_tokens and len(tokens) < limit:
        if use_cache:
            row = forward_cached(model, torch.tensor([pending], device=device), cache)[0, -1]
        else:
            row = model.logits(torch.tensor([tokens], device=device))[0, -1]
        token = next_token(row, sampling, generator)
        tokens.append(token)
        new.append(token)
        pending = [token]
        if token in stop_ids:
            break
    return new


def check_generation(model: LocalModel, prompt: list[int]) -> int:
    """The model's last position, once the model generates and the prompt leaves room."""
    if not model.cfg.family.generates:
        raise ValueError(f"generation needs a GPT checkpoint (model.arch="
                         f"{family_names(lambda f: f.generates)}); this one is {model.cfg.arch}")
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token (e.g. some text)")
    limit, key = model.cfg.max_positions, _limit_key(model.cfg)
    if len(prompt) >= limit:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model sees at most "
                         f"{key}={limit}, so nothing is left to generate")
    return limit


def _limit_key(cfg) -> str:
    return ("model.max_position_embeddings" if cfg.max_positions != cfg.seq_length
            else "model.seq_length")
