"""GPT: pre-norm causal decoder. With the default block (GPT-2's): learned positions, LayerNorm,
GeLU, tied input/output embeddings; with `model.preset: llama` the same decoder is Llama-style
(rotary positions, RMSNorm, SwiGLU, grouped-query attention, untied output layer).

A model is built as one or more *chunks* (virtual pipeline stages); with a single stage the
chunk is the whole model. The first chunk embeds, the last one applies the final norm, the
output layer and the vocab-parallel loss, and runs the multi-token-prediction depths
(models/mtp.py) when model.mtp_layers > 0.
"""

from __future__ import annotations

from ptdp.models.chunk import ModelChunk
from ptdp.models.embedding import logits
from ptdp.models.transformer import ModelContext
from ptdp.parallel.cross_entropy import vocab_parallel_cross_entropy


class GPTChunk(ModelChunk):
    def __init__(self, ctx: ModelContext, stage: int, num_stages: int, layers: range):
        super().__init__(ctx, stage, num_stages, layers, causal=True)

    def forward(self, hidden, batch):
        """hidden: [s, b, h] from the previous stage (None on the first); batch: tensors [b, s].

        Returns the hidden state, or on the last stage (loss, {name: detached value}).
        """
        positions = batch.get("position_ids")          # data.reset_position_ids
        if self.is_first:
            hidden = self.embedding(batch["tokens"], positions=positions)
        labels = batch["labels"]   # [b, s], or this context rank's s/c tokens
        # data.reset_attention_mask's document ids (the whole sequence's), sliding windows
        attend = self.attention_mask(labels.shape[1], labels.device,
                                     documents=batch.get("document_ids"))
        hidden = self.stack(hidden, attend, positions)
        if not self.is_last:
            return self.with_aux_losses(hidden)
        hidden = self.final_ln(hidden)
        loss = self.mean_loss(hidden, labels, batch["loss_mask"], batch.get("loss_count"))
        ahead = ({} if self.mtp is None else
                 self.mtp(hidden, batch, self.embedding, self.mean_loss, attend, positions))
        return self.with_aux_losses((loss, {"lm_loss": loss.detach()}), ahead)

    def mean_loss(self, hidden, labels, mask, count=None):
        """The micro-batch's mean loss over the positions `mask` [b, s] counts, from the
        normalised hidden state [s, b, h] and `labels` [b, s]. With context parallelism this rank
        holds part of the sequence: its share of the mean, over the whole sequence's mask count
        `count` (the batch carries it; None: this rank's mask holds the whole sequence)."""
        # with sequence parallelism the logits GEMM all-gathers the final hidden state
        out = logits(hidden, self.output_table(), self.ctx,
                     sequence_sharded=self.ctx.tp.sequence_parallel, ops=self.weight_ops)
        per_token = vocab_parallel_cross_entropy(out, labels.t(), self.ctx.model.vocab_size,
                                                 self.ctx.tp, fused=self.ctx.compile)
        mask = mask.t().to(per_token.dtype)
        count = mask.sum() if count is None else count.to(per_token.dtype)
        return (per_token * mask).sum() / count.clamp(min=1.0)
