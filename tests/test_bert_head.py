"""BERT's masked-LM head on the masked positions only (models/bert.py).

The loss reads the logits of the masked positions alone (about one token in seven), so the
head's dense layer, norm, logits and loss run on those rows: the same loss and the same
gradients as the head over all s * b tokens, to fp32 round-off. The rows are listed on the host
by the data pipeline (ptdp/data/batching.py `loss_rows`), so a GPU never has to report how many
there are; a batch without them (a test's, a tool's) finds them on the device.
"""

import pytest
import torch
import torch.nn.functional as F

from ptdp.config import ModelConfig
from ptdp.data.batching import MicroBatches, loss_rows
from ptdp.data.synthetic import synthetic_datasets
from ptdp.models import build_chunk
from ptdp.models.embedding import logits
from ptdp.models.transformer import ModelContext
from ptdp.parallel.cross_entropy import vocab_parallel_cross_entropy
from ptdp.parallel.mappings import TensorParallel
from ptdp.parallel.rng import TensorParallelRNG

L, H, A, S, V, B = 2, 32, 4, 32, 128, 4


def _chunk():
    cfg = ModelConfig(arch="bert", num_layers=L, hidden_size=H, num_heads=A, seq_length=S,
                      vocab_size=V, dropout=0.0)
    ctx = ModelContext(cfg, TensorParallel(), 7, TensorParallelRNG(7, 0, torch.device("cpu")), V)
    return cfg, build_chunk(ctx, 0, 1)


def _dense_lm_loss(chunk, hidden, batch):
    """The head as it was: over every token, the loss weighted by the mask."""
    heads = chunk.heads
    lm = heads.lm_ln(F.gelu(heads.lm_dense(hidden)))
    per_token = vocab_parallel_cross_entropy(
        logits(lm, chunk.output_table(), heads.ctx, heads.lm_bias), batch["labels"].t(), V,
        heads.ctx.tp)
    mask = batch["loss_mask"].t().to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def _loss_and_grads(chunk, batch, head):
    chunk.zero_grad()
    hidden = chunk.final_ln(chunk.stack(chunk.embedding(batch["tokens"], batch["types"]),
                                        chunk.attention_mask(S, torch.device("cpu"),
                                                             padding=batch["padding_mask"])))
    loss = head(hidden)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in chunk.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("listed", [False, True])
def test_the_head_on_the_masked_rows_equals_the_head_on_every_token(listed):
    """`listed`: the rows as the data pipeline lists them, padded with a position whose loss
    does not count; else found on the device."""
    cfg, chunk = _chunk()
    batch = torch.utils.data.default_collate(
        [synthetic_datasets(cfg, 3)["train"][i] for i in range(B)])
    assert 0 < batch["loss_mask"].sum() < B * S / 4   # most rows are skipped
    if listed:
        batch["loss_rows"] = loss_rows(batch["loss_mask"])
        assert len(batch["loss_rows"]) > batch["loss_mask"].sum()   # padded
    sparse, sparse_grads = _loss_and_grads(
        chunk, batch, lambda h: chunk.heads(h, chunk.output_table(), batch)[0])
    dense, dense_grads = _loss_and_grads(
        chunk, batch, lambda h: _dense_lm_loss(chunk, h, batch) + _sop_loss(chunk, h, batch))
    assert torch.allclose(sparse, dense, rtol=1e-6, atol=0)
    assert sparse_grads.keys() == dense_grads.keys()
    for name, grad in dense_grads.items():
        assert torch.allclose(sparse_grads[name], grad, rtol=1e-5, atol=1e-7), name


def _sop_loss(chunk, hidden, batch):
    heads = chunk.heads
    pooled = torch.tanh(heads.pooler(hidden[0]))
    return F.cross_entropy(heads.binary(pooled).float(), batch["sop_label"].view(-1))


def test_the_data_pipeline_lists_the_rows_on_the_host():
    cfg, _ = _chunk()
    data = synthetic_datasets(cfg, 3)["train"]
    micro = MicroBatches(data, global_batch=B, micro_batch_size=B, data_rank=0, data_size=1,
                         device=torch.device("cpu"))
    batch = micro.build(0, 0)
    rows = batch["loss_rows"]
    assert rows.dtype == torch.int64 and rows.device.type == "cpu"
    flat = batch["loss_mask"].t().reshape(-1)
    masked = flat.nonzero().squeeze(1)
    assert torch.equal(rows[:len(masked)], masked)
    # rounded up to a multiple of 64 with positions whose loss does not count
    assert len(rows) == 64 and flat[rows[len(masked):]].eq(0).all()
    assert torch.equal(loss_rows(batch["loss_mask"]), rows)
    gpt = MicroBatches(synthetic_datasets(ModelConfig(seq_length=S, vocab_size=V), 3)["train"],
                       global_batch=B, micro_batch_size=B, data_rank=0, data_size=1,
                       device=torch.device("cpu"))
    assert "loss_rows" not in gpt.build(0, 0)   # a decoder's loss reads every token


def test_the_rows_are_rounded_up_only_while_unmasked_positions_remain():
    """Every token masked: nothing to pad with, and s * b rows is one shape anyway."""
    assert torch.equal(loss_rows(torch.ones(2, 5)), torch.arange(10))
    assert len(loss_rows(torch.zeros(2, 5))) == 0
    mask = torch.zeros(3, 50)
    mask[0, :3] = 1
    assert loss_rows(mask).tolist() == [0, 3, 6] + [1] * 61   # [s * b] is sequence-major


def test_a_blend_of_masked_lm_datasets_is_one():
    from ptdp.data.blend import BlendedDataset
    bert_cfg, _ = _chunk()
    bert = synthetic_datasets(bert_cfg, 3)
    gpt = synthetic_datasets(ModelConfig(seq_length=S, vocab_size=V), 3)
    assert BlendedDataset([bert["train"], bert["valid"]], [1, 1], size=8).masked_lm
    assert not BlendedDataset([bert["train"], gpt["train"]], [1, 1], size=8).masked_lm
