"""`build_datasets(cfg)`: the trainer's entry point for `data.source: indexed`.

Opens every prefix in `data.paths`, checks that the data, the tokenizer and the model agree
on the vocabulary, deals each dataset's documents to the splits by `data.split` after a
seeded shuffle (so validation is drawn from the whole corpus), builds GPT or BERT
samples per split and blends several prefixes by weight.
"""

from __future__ import annotations

import numpy as np

from ptdp.config import Config, ConfigError, parse_paths, parse_split  # noqa: F401 (re-exported)
from ptdp.data.bert_dataset import BertDataset
from ptdp.data.blend import BlendedDataset
from ptdp.data.gpt_dataset import GPTDataset
from ptdp.data.indexed import IndexedDataError, IndexedDataset

SPLITS = ("train", "valid", "test")


def split_bounds(split: str, num_docs: int) -> list[tuple[int, int]]:
    """'98,1,1' -> document ranges [(0, a), (a, b), (b, num_docs)] in proportion."""
    ratios = parse_split(split)
    edges = np.round(np.cumsum([0.0] + ratios) / sum(ratios) * num_docs).astype(int)
    return [(int(edges[k]), int(edges[k + 1])) for k in range(3)]


def split_documents(split: str, num_docs: int, seed: int) -> list[np.ndarray]:
    """Document ids of the train, valid and test splits, in `data.split` proportion.

    Documents are dealt to the splits after a seeded shuffle, so every split is drawn from the
    whole corpus like the training split (a corpus stored in some order, e.g. by source or
    topic, would otherwise validate on its tail only). Ids are sorted within a split; the
    datasets shuffle their documents and samples themselves.
    """
    order = np.random.default_rng([seed, SPLIT_STREAM]).permutation(num_docs)
    return [np.sort(order[a:b]) for a, b in split_bounds(split, num_docs)]


SPLIT_STREAM = 7919  # keeps the split's shuffle apart from the datasets' (same seed)


def check_vocab(cfg: Config, datasets: list[IndexedDataset]) -> None:
    """Data, tokenizer and model must agree on the vocabulary; errors name the files.

    A Megatron pair without ptdp's sidecar has no recorded vocabulary (`vocab_size` None):
    it is checked against nothing, and model.vocab_size is trusted."""
    known = [ds for ds in datasets if ds.vocab_size is not None]
    if not known:
        return
    first = known[0]
    for ds in known[1:]:
        if (ds.vocab_size, ds.meta.get("tokenizer_fingerprint")) != \
                (first.vocab_size, first.meta.get("tokenizer_fingerprint")):
            raise IndexedDataError(f"{ds.idx_path} and {first.idx_path} were tokenised with "
                                   f"different vocabularies; blend only data from one tokenizer")
    if cfg.data.tokenizer:
        from ptdp.data.tokenizer import load_tokenizer

        tok = load_tokenizer(cfg.data.tokenizer)
        data_fp = first.meta.get("tokenizer_fingerprint")
        if tok.vocab_size != first.vocab_size or (data_fp and data_fp != tok.fingerprint):
            raise IndexedDataError(
                f"tokenizer {tok.path} (vocab_size {tok.vocab_size}, fingerprint {tok.fingerprint}) "
                f"does not match the vocabulary {first.idx_path} was tokenised with (vocab_size "
                f"{first.vocab_size}, fingerprint {data_fp}, tokenizer "
                f"{first.meta.get('tokenizer', 'unknown')}); point data.tokenizer at that model "
                f"or re-run `ptdp preprocess` with this one")
    if cfg.model.vocab_size < first.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary "
                          f"of {first.idx_path} ({first.vocab_size}); set "
                          f"model.vocab_size={first.vocab_size}")


def _split_dataset(cfg: Config, indexed: IndexedDataset, documents: np.ndarray, name: str):
    m = cfg.model
    if m.arch == "bert":
        return BertDataset(indexed, 0, 0, seq_length=m.seq_length, seed=cfg.train.seed,
                           mask_prob=cfg.data.mask_prob, name=name, documents=documents)
    return GPTDataset(indexed, 0, 0, seq_length=m.seq_length, seed=cfg.train.seed, name=name,
                      documents=documents)


def _combine(parts: list, weights: list[float]):
    """One dataset as is; several blended, leaving out those with no samples in this split."""
    if len(parts) == 1:
        return parts[0]
    kept = [(p, w) for p, w in zip(parts, weights) if len(p) > 0 and w > 0]
    if not kept:
        return parts[0]  # empty; indexing it raises an error that names the split
    return BlendedDataset([p for p, _ in kept], [w for _, w in kept])


def build_datasets(cfg: Config) -> dict:
    """{'train', 'valid', 'test'} map-style datasets of numpy sample dicts (see gpt/bert_dataset)."""
    pairs = parse_paths(cfg.data.paths)
    indexed = [IndexedDataset(prefix) for _, prefix in pairs]
    check_vocab(cfg, indexed)
    per_split: dict[str, list] = {name: [] for name in SPLITS}
    for ds in indexed:
        splits = split_documents(cfg.data.split, ds.num_documents, cfg.train.seed)
        for name, documents in zip(SPLITS, splits):
            per_split[name].append(_split_dataset(cfg, ds, documents, name))
    weights = [w for w, _ in pairs]
    out = {name: _combine(parts, weights) for name, parts in per_split.items()}
    if len(out["train"]) == 0:
        raise IndexedDataError(
            f"the train split of {', '.join(p for _, p in pairs)} has no samples: too few tokens "
            f"(or, for BERT, no documents with two sentences) for model.seq_length="
            f"{cfg.model.seq_length} and data.split={cfg.data.split}")
    return out
