"""ptdp generate --speculative (ptdp/inference/speculative.py): drafting with the model's
multi-token-prediction depth gives greedy decoding's tokens exactly, whichever drafts are
kept, in one decoder forward per step and one fewer per kept draft; sampled, each token keeps
the decoder's distribution. Tiny random models in one process: their own depth's drafts are
mostly wrong, so a drafter that knows the greedy answer decides which are right."""

from __future__ import annotations

import pytest
import torch

from ptdp.config import ModelConfig, load_config
from ptdp.inference import speculative
from ptdp.inference.generate import Sampling, generate, token_probabilities
from ptdp.inference.local_model import LocalModel, initial_state
from ptdp.inference.speculative import Drafts, MtpDrafter, _Verifier, generate_speculative

LLAMA = dict(arch="gpt", preset="llama", num_layers=2, hidden_size=32, num_heads=4,
             num_kv_heads=2, ffn_hidden_size=64, seq_length=40, vocab_size=600, init_std=0.3,
             mtp_layers=1)
# DeepSeek-V3's pieces: latent attention, and an MoE layer in the depth (the last layer's kind)
DEEPSEEK = dict(LLAMA, head_dim=8, mla_kv_lora_rank=12, mla_q_lora_rank=16,
                mla_rope_head_dim=4, mla_v_head_dim=6, num_experts=4, moe_top_k=2,
                moe_ffn_hidden_size=16, moe_first_dense_layers=1)
PROMPT = [5, 77, 301, 9]


def _model(**changes) -> LocalModel:
    cfg = ModelConfig(**{**LLAMA, **changes})
    return LocalModel(cfg, initial_state(cfg, seed=3))


@pytest.fixture(scope="module")
def model():
    return _model()


class Oracle(MtpDrafter):
    """The depth runs as usual (its cache grows alike), but its logits put the draft on the
    greedy answer where right(call) says so, and on a wrong token elsewhere."""

    def __init__(self, model, greedy: list[int], right):
        super().__init__(model)
        self.greedy, self.right, self.calls = greedy, right, 0

    def logits(self, hidden, next_tokens):
        out = super().logits(hidden, next_tokens)
        self.calls += 1
        # the depth's last position is cache.length - 1: it drafts the token 2 after it
        answer = self.greedy[self.cache.length + 1]
        drafted = answer if self.right(self.calls) else (answer + 1) % 600
        return out.index_fill(0, torch.tensor([drafted]), out.max() + 1)


def _counting_forwards(monkeypatch) -> list:
    calls = []
    real = speculative.hidden_cached
    monkeypatch.setattr(speculative, "hidden_cached",
                        lambda *args: calls.append(args[1].shape[1]) or real(*args))
    return calls


@pytest.mark.parametrize("blocks", [{}, DEEPSEEK], ids=["llama", "latent-moe"])
def test_its_own_drafts_give_greedy_decodings_tokens(blocks):
    model = _model(**blocks)
    for prompt in (PROMPT, [1], list(range(30, 50))):
        drafts = Drafts()
        assert generate_speculative(model, prompt, 16, drafts=drafts) == \
            generate(model, prompt, 16, Sampling())
        assert drafts.proposed > 0


@pytest.mark.parametrize("pattern", [lambda n: True, lambda n: n % 3 != 0, lambda n: n % 2 == 0],
                         ids=["all-right", "two-of-three", "every-other"])
def test_kept_drafts_save_a_forward_each_and_change_no_token(model, pattern, monkeypatch):
    greedy = PROMPT + generate(model, PROMPT, 30, Sampling())
    forwards = _counting_forwards(monkeypatch)
    drafts = Drafts()
    new = generate_speculative(model, PROMPT, 25, drafts=drafts,
                               drafter=Oracle(model, greedy, pattern))
    assert new == greedy[len(PROMPT):len(PROMPT) + 25]
    assert drafts.accepted > 0
    # the prompt's forward gives one token, each later one 1 + (its draft kept)
    assert len(forwards) == 1 + (len(new) - 1 - drafts.accepted)
    assert forwards[0] == len(PROMPT) and all(n in (1, 2) for n in forwards[1:])


@pytest.mark.parametrize("max_new", [1, 2, 3, 4, 7])
def test_lengths_stops_and_the_last_position_are_greedy_decodings(model, max_new):
    greedy = PROMPT + generate(model, PROMPT, 40, Sampling())
    right = lambda n: True   # noqa: E731  (every draft kept: the two-token steps' edges)
    assert generate_speculative(model, PROMPT, max_new, drafter=Oracle(model, greedy, right)) \
        == greedy[len(PROMPT):len(PROMPT) + max_new]
    # a stop token that arrives as a kept draft ends the generation there, kept
    stop = greedy[len(PROMPT) + max_new]
    assert generate_speculative(model, PROMPT, 40, stop_ids=[stop],
                                drafter=Oracle(model, greedy, right)) \
        == generate(model, PROMPT, 40, Sampling(), stop_ids=[stop])
    # up to model.seq_length = 40 positions, whatever the prompt's length
    near = list(range(40 - max_new - 1))
    assert generate_speculative(model, near, 100) == generate(model, near, 100, Sampling())


def test_a_model_without_a_depth_is_refused():
    with pytest.raises(ValueError, match=r"multi-token-prediction depth.*mtp_layers = 0"):
        generate_speculative(_model(mtp_layers=0), PROMPT, 4)


def test_the_command_prints_greedy_decodings_text_and_the_drafts_kept(model, tmp_path, capsys):
    from ptdp.checkpoint.save import save_full_state
    from ptdp.cli import main
    from ptdp.data.tokenizer import Tokenizer, train_tokenizer
    from tests.data.conftest import load_make_corpus
    corpus = tmp_path / "corpus.jsonl"
    assert load_make_corpus().main(["--output", str(corpus), "--max-docs", "300"]) == 0
    tok = train_tokenizer(corpus, tmp_path / "tok", LLAMA["vocab_size"], "bpe")
    cfg = load_config(None, [f"model.{k}={v}" for k, v in LLAMA.items()])
    cfg.data.tokenizer = str(tok.path)
    save_full_state(model.full_state(), cfg, tmp_path / "ckpt")
    capsys.readouterr()
    args = ["generate", str(tmp_path / "ckpt"), "--prompt", "The file", "--max-new-tokens", "8",
            "--device", "cpu"]
    assert main(args + ["--speculative"]) == 0
    out, err = capsys.readouterr()
    ids = Tokenizer(tok.path).encode("The file")
    assert out.splitlines() == [Tokenizer(tok.path).decode(ids + generate(model, ids, 8,
                                                                          Sampling()))]
    [line] = err.splitlines()
    assert line.startswith("ptdp generate: ") and line.endswith(" drafts kept")
    assert main(args + ["--speculative", "--no-cache"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ptdp generate: --speculative decodes with the cache: drop --no-cache"]
    assert main(args + ["--speculative", "--temperature", "0.8", "--top-k", "20"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("The file") and err.endswith(" drafts kept\n")


def test_the_depth_drafts_what_the_training_forward_predicts(model):
    """The depth run position by position with its cache equals models/mtp.py's training
    forward over the whole sequence: its greedy guess at each position is the argmax of the
    depth's logits there."""
    tokens = torch.tensor([PROMPT + [11, 12, 13, 14]])
    chunk = model.chunk
    with torch.no_grad():
        hidden = model.hidden(tokens)                                    # [s, 1, h]
        depth = chunk.mtp[0]
        ahead = chunk.embedding(torch.roll(tokens, -1, 1))               # token i + 1 at i
        whole = speculative.vocab_logits(model, depth(hidden, ahead))[0].argmax(-1)
    drafter = MtpDrafter(model)
    s = tokens.shape[1]
    guesses = [int(drafter.logits(hidden[i:i + 1], [int(tokens[0, (i + 1) % s])]).argmax())
               for i in range(s)]
    assert guesses == whole.tolist()


@pytest.mark.timeout(300)
def test_the_benchmark_trains_decodes_both_ways_and_writes_its_table(tmp_path, capsys):
    import json

    import tools.bench_speculative as tool
    assert tool.main(["--layers", "1", "--hidden", "32", "--seq", "24", "--vocab", "64",
                      "--iters", "2", "--prompts", "2", "--prompt-tokens", "4",
                      "--new-tokens", "10", "--rounds", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["same_tokens"] and result["new_tokens"] == 20
    assert 0 < result["drafts_proposed"] <= 18   # at most 9 per prompt: the first token is free
    assert result["decoder_forwards_per_token"]["speculative"] == \
        pytest.approx((20 - result["drafts_kept"]) / 20)
    assert "speculative speedup" in capsys.readouterr().out


def _total_variation(counts: torch.Tensor, exact: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - exact).abs().sum())


def test_a_sampled_draft_kept_or_replaced_is_distributed_as_the_decoders_token():
    """Speculative sampling's rule alone: a draft drawn from q, kept with probability
    min(1, p/q), else replaced by a draw from (p - q)+: the token is distributed as p, however
    far q is from p (here half their mass apart), top-k and top-p cuts included."""
    g = torch.Generator().manual_seed(0)
    for sampling in (Sampling(1.0), Sampling(0.7, top_k=6, top_p=0.9)):
        draft_logits, logits = torch.randn(8, generator=g) * 2, torch.randn(8, generator=g) * 2
        p = token_probabilities(logits, sampling)
        assert _total_variation(token_probabilities(draft_logits, sampling), p) > 0.4
        verify, counts = _Verifier(sampling, torch.Generator().manual_seed(1)), torch.zeros(8)
        for _ in range(5_000):
            draft, q = verify.propose(draft_logits)
            kept, instead = verify.keeps(draft, q, logits)
            counts[draft if kept else instead] += 1
        assert _total_variation(counts, p) < 0.025   # sampling noise: about 0.007


def test_sampled_speculative_decoding_draws_the_decoders_distribution():
    """The second and third new tokens (the first checked draft, and the token after it or
    after the replaced draft) over 600 seeds, against their exact distribution under the
    decoder alone (every prefix of a vocabulary of 8 enumerated): within sampling noise. The
    first token is generate()'s own draw (the same generator, seeded alike)."""
    cfg = ModelConfig(**{**LLAMA, "num_layers": 1, "hidden_size": 16, "num_heads": 2,
                         "ffn_hidden_size": 32, "seq_length": 8, "vocab_size": 8,
                         "init_std": 0.5})
    tiny = LocalModel(cfg, initial_state(cfg, seed=3))
    prompt, v = [1, 2], 8
    with torch.no_grad():
        first = tiny.logits(torch.tensor([prompt]))[0, -1].softmax(-1)
        second = tiny.logits(torch.tensor([prompt + [a] for a in range(v)]))[:, -1].softmax(-1)
        third = tiny.logits(torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)]))
    joint = first[:, None, None] * second[:, :, None] * third[:, -1].softmax(-1).view(v, v, v)
    counts, drafts = torch.zeros(2, v), Drafts()
    for seed in range(600):
        new = generate_speculative(tiny, prompt, 3, Sampling(1.0, seed=seed), drafts=drafts)
        assert new[0] == generate(tiny, prompt, 1, Sampling(1.0, seed=seed))[0]
        counts[0, new[1]] += 1
        counts[1, new[2]] += 1
    assert 0.2 < drafts.accepted / drafts.proposed < 0.8   # both ways taken
    assert _total_variation(counts[0], joint.sum((0, 2))) < 0.1   # measured: 0.04
    assert _total_variation(counts[1], joint.sum((0, 1))) < 0.1
