"""Data: tokenizers, indexed .bin/.idx datasets (Megatron-LM's format), GPT/BERT samples,
blending.

`build_datasets(cfg)` is what the trainer calls for `data.source: indexed`; the command line
(`ptdp tokenizer train`, `ptdp preprocess`) lives in `ptdp/commands/data.py`.
"""

from ptdp.data.build import build_datasets
from ptdp.data.indexed import IndexedDataError, IndexedDataset, IndexedDatasetWriter
from ptdp.data.tokenizer import Tokenizer, TokenizerError

__all__ = ["build_datasets", "IndexedDataError", "IndexedDataset", "IndexedDatasetWriter",
           "Tokenizer", "TokenizerError"]
