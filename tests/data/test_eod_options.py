"""The end-of-document options (data.reset_position_ids, data.reset_attention_mask,
data.eod_mask_loss) from the sample to the loss, and model.attention_dropout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ptdp.config import ConfigError, ModelConfig, load_config
from ptdp.data import build_datasets
from ptdp.data.gpt_dataset import EodOptions, gpt_sample
from ptdp.data.indexed import IndexedDatasetWriter
from ptdp.inference.local_model import build_single_stage
from ptdp.models.attention import document_mask

from .conftest import make_config

E = 3   # the <eod> id in these tests
ALL = EodOptions(E, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


def test_hand_built_sample():
    text = np.array([5, E, 7, 8, E, E, 9, 4])        # L = 7 inputs, then the last label
    s = gpt_sample(text, ALL)
    assert s["tokens"].tolist() == [5, E, 7, 8, E, E, 9]
    assert s["labels"].tolist() == [E, 7, 8, E, E, 9, 4]
    assert s["position_ids"].tolist() == [0, 1, 0, 1, 2, 0, 0]   # restart after each <eod>
    assert s["document_ids"].tolist() == [0, 0, 1, 1, 1, 2, 3]   # the <eod> ends its document
    assert s["loss_mask"].tolist() == [1, 0, 1, 1, 0, 0, 1]      # no loss where the input is <eod>
    plain = gpt_sample(text)   # no option on
    assert set(plain) == {"tokens", "labels", "loss_mask"} and plain["loss_mask"].all()
    mask = document_mask(torch.tensor(s["document_ids"])[None])[0]
    expected = torch.tensor([[1, 0, 0, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0, 0, 0],
                             [0, 0, 1, 0, 0, 0, 0],
                             [0, 0, 1, 1, 0, 0, 0],
                             [0, 0, 1, 1, 1, 0, 0],
                             [0, 0, 0, 0, 0, 1, 0],
                             [0, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def reference_sample(text: np.ndarray) -> dict:
    """Megatron's `_get_ltor_masks_and_position_ids`, written out as its loop."""
    tokens = text[:-1]
    n = tokens.size
    keep, positions = np.tril(np.ones((n, n), dtype=bool)), np.arange(n)
    prev = 0
    for i in np.flatnonzero(tokens == E):
        keep[i + 1:, :i + 1] = False
        positions[i + 1:] -= i + 1 - prev
        prev = i + 1
    return {"keep": keep, "position_ids": positions, "loss_mask": (tokens != E).astype(np.float32)}


def test_indexed_gpt_samples_carry_the_options(tmp_path):
    """ptdp's own sample order: every sample's fields equal Megatron's loop."""
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "d", 64, {"special_ids": {"<eod>": E}}) as writer:
        for _ in range(40):
            writer.add_document([np.append(rng.integers(4, 64, int(rng.integers(0, 12))), E)])
    cfg = make_config(f"data.paths=[{tmp_path / 'd'}]", "model.seq_length=16",
                      "data.reset_position_ids=true", "data.reset_attention_mask=true",
                      "data.eod_mask_loss=true", "model.vocab_size=64")
    train = build_datasets(cfg)["train"]
    assert len(train) > 10
    for i in range(len(train)):
        sample = train[i]
        ref = reference_sample(np.append(sample["tokens"], sample["labels"][-1]))
        doc = sample["document_ids"]
        assert np.array_equal((doc[:, None] == doc[None, :]) & np.tri(doc.size, dtype=bool),
                              ref["keep"])
        assert np.array_equal(sample["position_ids"], ref["position_ids"])
        assert np.array_equal(sample["loss_mask"], ref["loss_mask"])


def gpt_loss(chunk, tokens, labels, loss_mask, **extra) -> float:
    batch = {"tokens": torch.tensor([tokens]), "labels": torch.tensor([labels]),
             "loss_mask": torch.tensor([loss_mask], dtype=torch.float32)}
    batch.update({k: torch.tensor([v]) for k, v in extra.items()})
    with torch.no_grad():
        return chunk(None, batch)[0].item()


@pytest.mark.parametrize("preset", ["gpt", "llama"])   # learned positions, rotary positions
def test_a_document_after_eod_trains_as_if_alone(preset):
    """With reset positions and the document mask, document B after A (ended by <eod>) gets
    exactly the loss B gets at the start of a sequence of its own; without them it does not."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=50,
                      preset=preset)
    chunk = build_single_stage(cfg, seed=3).eval()
    rng = np.random.default_rng(1)
    a, b = np.append(rng.integers(4, 50, 5), E), rng.integers(4, 50, 10)
    b_labels, junk = rng.integers(4, 50, 10), rng.integers(4, 50, 6)
    together = np.concatenate([a, b]).tolist()
    labels = np.concatenate([rng.integers(4, 50, 6), b_labels]).tolist()
    on_b = [0.0] * 6 + [1.0] * 10
    alone = gpt_loss(chunk, np.concatenate([b, junk]).tolist(),
                     np.concatenate([b_labels, junk]).tolist(), [1.0] * 10 + [0.0] * 6)
    positions = list(range(6)) + list(range(10))
    documents = [0] * 6 + [1] * 10
    both = gpt_loss(chunk, together, labels, on_b, position_ids=positions, document_ids=documents)
    assert both == pytest.approx(alone, rel=1e-6)
    plain = gpt_loss(chunk, together, labels, on_b)
    only_mask = gpt_loss(chunk, together, labels, on_b, document_ids=documents)
    only_positions = gpt_loss(chunk, together, labels, on_b, position_ids=positions)
    for changed in (plain, only_positions):
        assert abs(changed - alone) > 1e-4
    if preset == "gpt":   # learned positions: the mask alone leaves B at positions 6..15
        assert abs(only_mask - alone) > 1e-4
    else:                 # rotary angles are relative: within B a shift changes nothing
        assert only_mask == pytest.approx(alone, rel=1e-6)


def test_attention_dropout_is_its_own_key():
    q, k, v = torch.randn(3, 1, 4, 8, 8).unbind(0)

    def twice(**drop):
        cfg = ModelConfig(num_layers=1, hidden_size=32, num_heads=4, seq_length=8, **drop)
        attention = build_single_stage(cfg).train().stack.layers[0].attention
        return [attention.core_attention(q, k, v, None) for _ in range(2)]

    first, second = twice(dropout=0.5, attention_dropout=0.0)   # hidden dropout only
    assert torch.equal(first, second)
    first, second = twice(dropout=0.0, attention_dropout=0.5)
    assert not torch.equal(first, second)
    first, second = twice(dropout=0.5)                           # null: model.dropout
    assert not torch.equal(first, second)
    assert ModelConfig(dropout=0.2).attention_dropout_rate == 0.2


@pytest.mark.parametrize("overrides, message", [
    (["data.eod_mask_loss=true"], "data.eod_mask_loss=true needs data.source=indexed"),
    (["data.sampling=megatron", "model.arch=bert", "data.source=indexed", "data.paths=[x]"],
     "data.sampling=megatron needs data.source=indexed and model.arch=gpt"),
    (["data.sampling=megatro"], "did you mean 'megatron'"),
    (["model.attention_dropout=1.5"], "model.attention_dropout must be in [0, 1)"),
])
def test_refused_combinations_name_the_keys(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, world_size=2 if "parallel.context=2" in overrides else 1)
    assert message in str(err.value)
