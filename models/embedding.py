"""Input embeddings and the output layer (the tied word table, or an untied one) of every model."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ptdp.models.transformer import ModelContext, _sequence_parallel_dropout
from ptdp.parallel.layers import VocabParallelEmbedding, normal_param, parallel_logits
from ptdp.parallel.roles import declare_role
from ptdp.parallel.sequence import mark_sequence_parallel, sequence_shard
from ptdp.parallel.weight_grad import PLAIN, WeightOps

WORD_EMBEDDING_KEY = "embedding.word"
OUTPUT_LAYER_KEY = "output_layer"


def word_embedding(ctx: ModelContext) -> VocabParallelEmbedding:
    """The vocab-parallel word table. The last pipeline stage builds its own copy from the same
    key, so input and output embeddings start identical and stay tied by gradient all-reduce."""
    cfg = ctx.model
    return VocabParallelEmbedding(cfg.vocab_size, ctx.padded_vocab_size, cfg.hidden_size, ctx.tp,
                                  seed=ctx.seed, key=WORD_EMBEDDING_KEY, std=cfg.init_std)


class Embedding(nn.Module):
    """word + learned position (+ token type for BERT) embeddings, then dropout; -> [s, b, h].
    With rotary positions (model.position_embedding=rope) there is no position table: the
    attention rotates queries and keys instead (models/rotary.py). With model.scale_embeddings
    the word embeddings are multiplied by sqrt(h) (Gemma; `words`).

    With sequence parallelism the word embedding is reduce-scattered, the other two are looked
    up for my tokens only, and the result is my [s/t, b, h] slice. With context parallelism the
    tokens are my two chunks of the sequence (ptdp/parallel/context.py) and the position rows
    theirs. `positions` [b, s] (data.reset_position_ids) picks each token's row instead; with
    context parallelism they arrive already cut to my chunks (ptdp/data/batching.py).
    """

    weight_ops = PLAIN   # the position and token-type lookups by index

    def __init__(self, ctx: ModelContext, num_tokentypes: int = 0):
        super().__init__()
        cfg = ctx.model
        self.word = word_embedding(ctx)
        replicated = lambda shape, key: mark_sequence_parallel(  # noqa: E731
            normal_param(shape, cfg.init_std, ctx.seed, key, None, ctx.tp), ctx.tp)
        self.position = (replicated((cfg.seq_length, cfg.hidden_size), "embedding.position")
                         if cfg.position_embedding == "learned" else None)
        self.tokentype = (replicated((num_tokentypes, cfg.hidden_size), "embedding.tokentype")
                          if num_tokentypes else None)
        self.dropout = cfg.dropout
        self.tp, self.cp = ctx.tp, ctx.cp
        self.scale = cfg.hidden_size ** 0.5 if cfg.scale_embeddings else None

    def words(self, tokens: torch.Tensor) -> torch.Tensor:
        """The word embeddings of `tokens` [s, b] (my [s/t, b, h] with sequence parallelism),
        times sqrt(h) with model.scale_embeddings: the factor rounded to the activations' dtype
        first, as Hugging Face's Gemma does (sqrt(3072) = 55.43 is 55.5 in bf16). (Rounded on
        the host: a device scalar made here would be a copy to the GPU every step.)"""
        x = self.word(tokens)
        if self.scale is None:
            return x
        return x * torch.tensor(self.scale, dtype=x.dtype).item()

    def _positions(self, length: int) -> torch.Tensor:
        """The position table's rows of my tokens: the first `length`, or with context
        parallelism the rows of my two chunks of the sequence."""
        if self.cp.size == 1:
            return self.position[:length]
        return self.position[self.cp.positions(length, self.position.device)]

    def forward(self, tokens: torch.Tensor, types: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        tokens = tokens.t()  # [b, s] -> [s, b]
        mine = lambda x: sequence_shard(x, self.tp)  # noqa: E731 - my tokens' rows (SP)
        x = self.words(tokens)
        if self.position is not None and positions is not None:
            x = x + self.weight_ops.embedding(mine(positions.t()), self.position)   # [s, b, h]
        elif self.position is not None:
            x = x + mine(self._positions(tokens.shape[0])).unsqueeze(1)
        if self.tokentype is not None:
            x = x + self.weight_ops.embedding(mine(types.t()), self.tokentype)
        if self.dropout == 0 or not self.training:
            return x
        if self.tp.sequence_parallel:
            return _sequence_parallel_dropout(x, self.dropout, self.tp)
        return F.dropout(x, self.dropout, self.training)


class OutputEmbedding(nn.Module):
    """The last stage's copy of the word table, used only to compute logits (p > 1).

    Its role (ptdp/parallel/roles.py): `shared_embedding`, so its gradient is summed with the
    first stage's, and `duplicate`, so norms and checkpoints count the weight once.
    """

    def __init__(self, ctx: ModelContext):
        super().__init__()
        self.weight = word_embedding(ctx).weight
        declare_role(self.weight, shared_embedding=True, duplicate=True)


class OutputLayer(nn.Module):
    """An untied output layer (model.tie_embeddings=false): a vocab-parallel [V, h] table of its
    own on the last stage, initialised from its own stream, padded like the word table."""

    def __init__(self, ctx: ModelContext):
        super().__init__()
        cfg = ctx.model
        self.weight = VocabParallelEmbedding(cfg.vocab_size, ctx.padded_vocab_size,
                                             cfg.hidden_size, ctx.tp, seed=ctx.seed,
                                             key=OUTPUT_LAYER_KEY, std=cfg.init_std).weight


def word_table_copy(ctx: ModelContext) -> Embedding:
    """The last stage's embedding when the first stage holds the original (p > 1) and the last
    embeds tokens too (multi-token prediction, models/mtp.py): its word table is a copy, with
    OutputEmbedding's role. (Only rotary models: there is no position table to share.)"""
    copy = Embedding(ctx)
    declare_role(copy.word.weight, shared_embedding=True, duplicate=True)
    return copy


def mark_shared(weight: torch.Tensor) -> None:
    """The first stage's word table when the head lives on another stage (p > 1)."""
    declare_role(weight, shared_embedding=True)


def logits(hidden: torch.Tensor, table: torch.Tensor, ctx: ModelContext, bias=None,
           sequence_sharded: bool = False, ops: WeightOps = PLAIN) -> torch.Tensor:
    """`ops`: the weight ops of the module computing them (its deferred weight gradients)."""
    return parallel_logits(hidden, table, ctx.tp, bias, sequence_sharded, ops)
