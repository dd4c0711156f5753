"""`ptdp convert --from megatron` / `--to megatron` against checkpoints megatron-core writes.

One module-scoped fixture builds a tiny megatron-core GPT (Llama-style: rotary positions,
RMSNorm, SwiGLU, grouped-query attention, untied output) and a tiny BERT on CPU and saves
each in Megatron-LM's legacy layout and with `dist_checkpointing.save` (torch_dist). The
tests convert them, compare ptdp's logits with megatron-core's forward on the same tokens,
go back to Megatron (loaded by megatron-core's own `load_state_dict`, strict) and train on.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from ptdp.inference.local_model import LocalModel, read_full_state  # noqa: E402
from tests.megatron import mcore_models as mc  # noqa: E402

TOKENS = torch.randint(0, mc.VOCAB, (2, mc.SEQ), generator=torch.Generator().manual_seed(0))
TYPES = torch.cat([torch.zeros(2, mc.SEQ // 2), torch.ones(2, mc.SEQ // 2)], 1).long()


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """Both models, their reference logits and their checkpoints in both formats."""
    root = tmp_path_factory.mktemp("megatron")
    with pytest.MonkeyPatch.context() as mp, mc.cpu_megatron(mp):
        gpt_args, bert_args = mc.gpt_args(), mc.bert_args()
        gpt, bert = mc.build_gpt(gpt_args), mc.build_bert(bert_args)
        out = {"gpt": gpt, "bert": bert, "gpt_args": gpt_args, "root": root,
               "gpt_logits": mc.gpt_logits(gpt, TOKENS),
               "bert_logits": mc.bert_logits(bert, TOKENS, TYPES)}
        mc.save_legacy(gpt, gpt_args, root / "gpt_legacy", 100)
        mc.save_torch_dist(gpt, gpt_args, root / "gpt_dist", 100)
        mc.save_legacy(bert, bert_args, root / "bert_legacy", 5)
        mc.save_torch_dist(bert, bert_args, root / "bert_dist", 5)
        yield out


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_gpt_logits_equal_megatron_core(megatron, fmt, tmp_path):
    from ptdp.megatron.checkpoint import from_megatron
    final, cfg, found = from_megatron(megatron["root"] / f"gpt_{fmt}", tmp_path / "ptdp",
                                      ["parallel.tensor=2", "parallel.pipeline=2"])
    assert found["format"] == {"legacy": "legacy", "dist": "torch_dist"}[fmt]
    assert final.name == "iter_0000100" and cfg.model.num_kv_heads == 2
    assert (cfg.model.activation, cfg.model.normalization, cfg.model.tie_embeddings) == \
        ("swiglu", "rmsnorm", False)
    model = LocalModel.from_checkpoint(tmp_path / "ptdp")
    _close(model.logits(TOKENS), megatron["gpt_logits"])


@pytest.mark.parametrize("fmt", ["legacy", "dist"])
def test_bert_logits_equal_megatron_core(megatron, fmt, tmp_path):
    from ptdp.megatron.checkpoint import from_megatron
    from_megatron(megatron["root"] / f"bert_{fmt}", tmp_path / "ptdp")
    model = LocalModel.from_checkpoint(tmp_path / "ptdp")
    lm, binary = megatron["bert_logits"]
    keep = torch.ones_like(TOKENS)
    _close(model.logits(TOKENS, TYPES, keep), lm)
    _close(model.sentence_order_logits(TOKENS, TYPES, keep), binary)
