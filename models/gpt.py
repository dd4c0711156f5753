"""GPT: pre-LN causal decoder with learned positions and tied input/output embeddings.

A model is built as one or more *chunks* (virtual pipeline stages); with a single stage the
chunk is the whole model. The first chunk embeds, the last one applies the final LayerNorm,
the tied output head and the vocab-parallel loss.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from models.embedding import Embedding, OutputEmbedding, logits, mark_shared
from models.transformer import ModelContext, TransformerStack, layer_norm
from ptdp.parallel.tensor import vocab_parallel_cross_entropy


class GPTChunk(nn.Module):
    def __init__(self, ctx: ModelContext, stage: int, num_stages: int):
        super().__init__()
        cfg = ctx.model
        per_stage = cfg.num_layers // num_stages
        self.ctx = ctx
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.embedding = Embedding(ctx) if self.is_first else None
        if self.is_first and not self.is_last:
            mark_shared(self.embedding.word.weight)
        self.stack = TransformerStack(ctx, stage * per_stage, per_stage, causal=True)
        if self.is_last:
            self.final_ln = layer_norm(cfg.hidden_size, cfg.layernorm_eps)
            self.output = None if self.is_first else OutputEmbedding(ctx)

    def output_table(self) -> torch.Tensor:
        return self.embedding.word.weight if self.output is None else self.output.weight

    def forward(self, hidden, batch):
        """hidden: [s, b, h] from the previous stage (None on the first); batch: tensors [b, s].

        Returns the hidden state, or on the last stage (loss, {name: detached value}).
        """
        if self.is_first:
            hidden = self.embedding(batch["tokens"])
        hidden = self.stack(hidden)
        if not self.is_last:
            return hidden
        out = logits(self.final_ln(hidden), self.output_table(), self.ctx)
        per_token = vocab_parallel_cross_entropy(out, batch["labels"].t(), self.ctx.model.vocab_size,
                                                 self.ctx.tp)
        mask = batch["loss_mask"].t().to(per_token.dtype)
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        return loss, {"lm_loss": loss.detach()}
