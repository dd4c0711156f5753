"""`build_datasets(cfg)`: the trainer's entry point for `data.source: indexed`.

Opens every prefix in `data.paths`, checks that the data, the tokenizer and the model agree
on the vocabulary, deals each dataset's documents to the splits by `data.split` after a
seeded shuffle (so validation is drawn from the whole corpus), builds GPT or BERT
samples per split and blends several prefixes by weight.

With `data.sampling: megatron` (GPT) the splits, the samples and the blend follow Megatron-LM
instead (`_build_megatron`): contiguous splits, as many epochs as `num_samples_needed(cfg)`
asks for, and blends of exactly that many samples.
"""

from __future__ import annotations

import numpy as np

from ptdp.config import Config, ConfigError, parse_paths, parse_split  # noqa: F401 (re-exported)
from ptdp.config.models import Samples
from ptdp.data.bert_dataset import BertDataset
from ptdp.data.blend import BlendedDataset, MegatronBlendedDataset
from ptdp.data.gpt_dataset import EodOptions, GPTDataset, MegatronGPTDataset
from ptdp.data.indexed import IndexedDataError, IndexedDataset
from ptdp.data.megatron_sampling import BLEND_SURPLUS, blend_sizes, normalize, split_ranges

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


def eod_options(cfg: Config, indexed: IndexedDataset) -> EodOptions | None:
    """The end-of-document options with the <eod> id: from the dataset's metadata (written by
    `ptdp preprocess`), else from data.tokenizer; None when no option is on."""
    data = cfg.data
    if not (data.reset_position_ids or data.reset_attention_mask or data.eod_mask_loss):
        return None
    eod = indexed.meta.get("special_ids", {}).get("<eod>")
    if eod is None and data.tokenizer:
        from ptdp.data.tokenizer import load_tokenizer

        eod = load_tokenizer(data.tokenizer).eod_id
    if eod is None:
        raise IndexedDataError(f"{indexed.idx_path}: the end-of-document id is unknown (no "
                               f"<eod> in its metadata) and data.tokenizer is not set; set "
                               f"data.tokenizer to use data.reset_position_ids, "
                               f"data.reset_attention_mask or data.eod_mask_loss")
    return EodOptions(int(eod), data.reset_position_ids, data.reset_attention_mask,
                      data.eod_mask_loss)


def _split_dataset(cfg: Config, indexed: IndexedDataset, documents: np.ndarray, name: str,
                   eod: EodOptions | None):
    """One split of one prefix; a GPT split checks every sample's ids against
    model.vocab_size as it reads it (ptdp/data/indexed.py `check_token_ids`)."""
    m = cfg.model
    if m.family.samples is Samples.SENTENCE_PAIRS:
        return BertDataset(indexed, 0, 0, seq_length=m.seq_length, seed=cfg.train.seed,
                           mask_prob=cfg.data.mask_prob, name=name, documents=documents)
    return GPTDataset(indexed, 0, 0, seq_length=m.seq_length, seed=cfg.train.seed, name=name,
                      documents=documents, eod=eod, vocab_limit=m.vocab_size)


def num_samples_needed(cfg: Config) -> dict[str, int]:
    """Samples the run draws from each split, by Megatron's rule (megatron/training/training.py
    `get_train_valid_test_num_samples`): train.train_samples in a sample-based run (at least
    what its iterations read, a ramp-up's included), else every training iteration's global
    batch; eval_iters batches at each of the iters // eval_interval + 1 evaluations; eval_iters
    for test."""
    tr = cfg.train
    batch = tr.global_batch_size
    train = tr.train_samples if tr.train_samples is not None else tr.iters * batch
    evaluations = tr.iters // tr.eval_interval + 1 if tr.eval_interval > 0 else 0
    return {"train": train, "valid": evaluations * tr.eval_iters * batch,
            "test": tr.eval_iters * batch}


def _megatron_splits(cfg: Config, indexed: IndexedDataset, samples: dict,
                     vocab_limit: int | None = None) -> list:
    """One prefix's MegatronGPTDatasets per split (None where data.split gives it nothing);
    `vocab_limit`: check every sample's ids against it (`build_datasets`: model.vocab_size)."""
    ranges = split_ranges(parse_split(cfg.data.split), len(indexed))
    eod = eod_options(cfg, indexed)
    return [None if bounds is None else
            MegatronGPTDataset(indexed, np.arange(*bounds, dtype=np.int32), cfg.model.seq_length,
                               samples[name], cfg.train.seed, name=name, eod=eod,
                               vocab_limit=vocab_limit)
            for name, bounds in zip(SPLITS, ranges)]


def _build_megatron(cfg: Config, pairs: list, indexed: list[IndexedDataset],
                    vocab_limit: int | None = None) -> dict:
    """Megatron's BlendedMegatronDatasetBuilder: one prefix without a weight (data.paths:
    [prefix]) is used as is; weighted prefixes each give ceil(ceil(N w) * 1.005) samples of
    which the blend takes sum(ceil(N w)) by the largest-error rule."""
    needed = num_samples_needed(cfg)
    if len(cfg.data.paths) == 1:
        return dict(zip(SPLITS, _megatron_splits(cfg, indexed[0], needed, vocab_limit)))
    weights = normalize([w for w, _ in pairs])
    targets = [blend_sizes(weights, needed[name]) for name in SPLITS]
    buffers = [blend_sizes(weights, needed[name], BLEND_SURPLUS) for name in SPLITS]
    per_prefix = [_megatron_splits(cfg, ds, {name: buffers[s][k] for s, name in enumerate(SPLITS)},
                                   vocab_limit) for k, ds in enumerate(indexed)]
    out = {}
    for s, name in enumerate(SPLITS):
        parts = [splits[s] for splits in per_prefix]
        out[name] = (None if parts[0] is None else
                     MegatronBlendedDataset(parts, weights, sum(targets[s]), name=name))
    return out


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
    if cfg.data.sampling == "megatron":
        out = {name: ds for name, ds in
               _build_megatron(cfg, pairs, indexed, cfg.model.vocab_size).items() if ds}
        return _check_train_split(cfg, pairs, out)
    per_split: dict[str, list] = {name: [] for name in SPLITS}
    for ds in indexed:
        splits = split_documents(cfg.data.split, ds.num_documents, cfg.train.seed)
        eod = eod_options(cfg, ds)
        for name, documents in zip(SPLITS, splits):
            per_split[name].append(_split_dataset(cfg, ds, documents, name, eod))
    weights = [w for w, _ in pairs]
    out = {name: _combine(parts, weights) for name, parts in per_split.items()}
    return _check_train_split(cfg, pairs, out)


def _check_train_split(cfg: Config, pairs: list, out: dict) -> dict:
    if len(out.get("train", ())) == 0:
        raise IndexedDataError(
            f"the train split of {', '.join(p for _, p in pairs)} has no samples: too few tokens "
            f"(or, for BERT, no documents with two sentences) for model.seq_length="
            f"{cfg.model.seq_length} and data.split={cfg.data.split}")
    return out
