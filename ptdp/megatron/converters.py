"""How Megatron-LM's argument values become ptdp's: the converters of the table in
ptdp/megatron/arguments.py, and the kinds of mapping.

A converter is `convert(value, given) -> value | dict | {}`: `value` is the argument's text
(True for a switch, a list for a list argument), `given` every argument of the command line
(flag -> value), for the few that depend on others. It returns the key's value, a dict of
several keys, or {} (nothing to write). `Differs(value, why)` maps with a stated difference;
raising `Unmapped(kind, why)` refuses or ignores the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Callable

from ptdp.config.catalogue import INTERLEAVED

EXACT, APPROXIMATE, IGNORED, REFUSED = "exact", "approximate", "ignored", "refused"
KINDS = (EXACT, APPROXIMATE, IGNORED, REFUSED)


class Unmapped(Exception):
    """A Megatron value ptdp does not take as it is: `kind` is refused or ignored (approximate
    for a default that cannot be written, only noted); `why` says why."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind, self.why = kind, why


@dataclass(frozen=True)
class Differs:
    """A value mapped with a difference the user should know (an approximate mapping)."""
    value: Any
    why: str


@dataclass(frozen=True)
class Default:
    """Megatron's default when it depends on other arguments: `value(given)` is the default's
    Megatron value, or None where it changes nothing; `text` describes it in the docs."""
    value: Callable[[dict], Any]
    text: str


# Converters --------------------------------------------------------------------------------

def integer(value, given):
    return int(value)


def number(value, given):
    return float(value)


def const(result):
    return lambda value, given: result


def choice(mapping: dict, why: str):
    """Map Megatron's choices to ptdp's; any other value is refused with `why`."""
    def convert(value, given):
        if value not in mapping:
            raise Unmapped(REFUSED, f"{value!r}: {why}")
        return mapping[value]
    return convert


def only(expected, why: str):
    """A value ptdp always uses (nothing to write); any other is refused with `why`."""
    def convert(value, given):
        if type(expected)(value) != expected:
            raise Unmapped(REFUSED, why)
        return {}
    return convert


def refuse(why: str):
    def convert(value, given):
        raise Unmapped(REFUSED, why)
    return convert


def ignore(why: str):
    def convert(value, given):
        raise Unmapped(IGNORED, why)
    return convert


def given_int(given: dict, flag: str, default: int | None = None) -> int | None:
    value = given.get(flag)
    return int(value) if value is not None else default


def chunks_from_layers(value, given):
    """--num-layers-per-virtual-pipeline-stage: v = layers / (p * layers per virtual stage)."""
    layers = given_int(given, "--num-layers")
    p = given_int(given, "--pipeline-model-parallel-size", 1)
    if layers is None:
        raise Unmapped(REFUSED, "needs --num-layers to work out parallel.chunks")
    per_rank, rest = divmod(layers, p * int(value))
    if rest or per_rank < 1:
        raise Unmapped(REFUSED, f"{layers} layers do not split into {p} stages of "
                                f"{value}-layer virtual stages")
    return chunks(per_rank, given)


def chunks(value, given):
    v = int(value)
    if v > 1:
        return {"parallel.chunks": v, "schedule.name": INTERLEAVED.name}
    return {"parallel.chunks": 1}


def kv_heads(value, given):
    """--group-query-attention: K/V heads are --num-query-groups (Megatron's default 1)."""
    return given_int(given, "--num-query-groups", 1)


def query_groups(value, given):
    if "--group-query-attention" not in given:
        raise Unmapped(IGNORED, "Megatron ignores it without --group-query-attention")
    return {}   # written by --group-query-attention


def _rope(given: dict) -> bool:
    return (given.get("--position-embedding-type") == "rope"
            or "--use-rotary-position-embeddings" in given)


def max_positions(value, given):
    seq = given_int(given, "--seq-length", given_int(given, "--encoder-seq-length"))
    if _rope(given) or int(value) == seq:
        return {}
    return Differs({}, f"ptdp's position table has model.seq_length ({seq}) rows, not {value}")


def no_position_embedding(value, given):
    if _rope(given):
        return {}
    raise Unmapped(REFUSED, "ptdp's models need learned or rotary positions")


def rope_scaling(value, given):
    return float(given.get("--rope-scaling-factor", 8.0))


def rope_scaling_factor(value, given):
    if "--use-rope-scaling" not in given:
        raise Unmapped(IGNORED, "Megatron uses it only with --use-rope-scaling")
    return {}   # written by --use-rope-scaling


def megatron_ffn_hidden_size(given: dict) -> int | None:
    """Megatron's SwiGLU default: 2/3 of 4h, rounded down to a multiple of 64 (ptdp rounds up
    to 256, Llama's rule); None where the defaults agree (4h) or h is unknown."""
    h = given_int(given, "--hidden-size")
    if h is None or "--swiglu" not in given:
        return None
    return int((4 * h * 2 / 3) / 64) * 64


def attention_dropout_default(given: dict):
    """Megatron's attention dropout is 0.1 whatever the hidden dropout; ptdp's follows
    model.dropout, so write it only where the two differ."""
    hidden = float(given.get("--hidden-dropout", 0.1))
    return None if math.isclose(hidden, 0.1) else 0.1


def vocab_size(value, given):
    if given.get("--tokenizer-type") == "NullTokenizer":   # Megatron adds the <eod> id
        return Differs(int(value) + 1, "NullTokenizer adds one id (end of document)")
    return int(value)


def data_paths(value, given):
    words = list(value)
    out = {"data.source": "indexed", "data.sampling": "megatron"}
    if len(words) == 1:
        return {**out, "data.paths": words}
    try:
        weights = [float(w) for w in words[::2]]
    except ValueError:
        weights = None
    if len(words) % 2 or weights is None:
        paths = [x for w in words for x in (1.0, w)]
        return Differs({**out, "data.paths": paths}, "prefixes without weights: Megatron weighs "
                       "them by size, ptdp writes equal weights; set the weights")
    return {**out, "data.paths": [x for w, p in zip(weights, words[1::2]) for x in (w, p)]}


def split(value, given):
    return ",".join(part.strip() for part in str(value).replace("/", ",").split(","))


def consumed_by_tokenizer_type(value, given):
    """--vocab-file / --merge-file / --tokenizer-model: with --tokenizer-type, written by it;
    alone, the file is the key's (vocab.json + merges.txt, vocab.txt, a .model or .json)."""
    return {} if "--tokenizer-type" in given else value


def merges_beside(vocab: str) -> list[str]:
    """Where ptdp looks for a GPT-2 vocabulary's merges (ptdp/data/vocab_tokenizers.py
    `merges_beside`, repeated here so the translator stays torch-free): `NAME-merges.txt` for
    `NAME-vocab.json` (Megatron's gpt2-vocab.json / gpt2-merges.txt), then `merges.txt`."""
    path = PurePath(vocab)
    stem = path.name[:-len("vocab.json")] if path.name.endswith("vocab.json") else None
    return [str(path.parent / name) for name in ([f"{stem}merges.txt"] if stem else [])
            + ["merges.txt"]]


def merge_file(value, given):
    """--merge-file: nothing to write when it lies where ptdp finds it from data.tokenizer."""
    vocab = given.get("--vocab-file")
    if vocab is None or str(PurePath(value)) in merges_beside(vocab):
        return {}
    return Differs({}, f"ptdp reads the merges beside the vocabulary "
                       f"({' or '.join(merges_beside(vocab))}); copy or link {value} there")


def tokenizer(value, given):
    vocab, model = given.get("--vocab-file"), given.get("--tokenizer-model")
    if value == "GPT2BPETokenizer":
        return {"data.tokenizer": vocab}
    if value in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return Differs({"data.tokenizer": vocab},
                       "the WordPiece vocabulary; Case vs LowerCase is not carried over")
    if value in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        return {"data.tokenizer": model}
    if value == "HuggingFaceTokenizer":
        if str(model).endswith(".json"):
            return {"data.tokenizer": model}
        return Differs({"data.tokenizer": f"{model}/tokenizer.json"},
                       "ptdp reads a local tokenizer.json (a hub name must be downloaded first)")
    if value == "NullTokenizer":
        raise Unmapped(IGNORED, "token ids need no tokenizer; model.vocab_size comes from "
                                "--vocab-size")
    raise Unmapped(REFUSED, f"{value!r}: ptdp reads sentencepiece, GPT-2 BPE, WordPiece and "
                            "Hugging Face tokenizer.json")


def load(value, given):
    if value == given.get("--save"):
        return Differs("auto", "resumes ptdp's checkpoints in --save; Megatron's own there must "
                               "first be converted (ptdp convert --from megatron)")
    return Differs(value, "a Megatron checkpoint must first be converted "
                          "(ptdp convert --from megatron)")


def recompute_method(value, given):
    if value == "uniform":
        return {}
    return Differs({}, "ptdp checkpoints every group of train.recompute_num_layers layers "
                       "(Megatron's uniform), not only the first ones (block)")


def hysteresis_default(given: dict):
    if "--fp16" not in given:
        return None
    raise Unmapped(APPROXIMATE, "Megatron's default 2 waits for two overflows before halving the "
                                "loss scale; ptdp halves at every overflow (--hysteresis 1)")


def global_batch_default(given: dict):
    raise Unmapped(APPROXIMATE, "Megatron's default is micro-batch-size x data-parallel size; "
                                "ptdp's is 8: set train.global_batch_size")


def seed(value, given):
    return Differs(int(value), "the same role; ptdp's initialisation draws other numbers")


def fp16_only(value, text: str) -> Default:
    """A default that matters only in fp16 (the loss scale's)."""
    return Default(lambda given: value if "--fp16" in given else None, f"{text} (with --fp16)")
