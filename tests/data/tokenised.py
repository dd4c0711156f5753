"""The tokenised datasets tests train and check on, written without Hugging Face `datasets`.

`ptdp preprocess` (ptdp/data/preprocess.py) tokenises through `datasets`, an optional extra, so
the tests that need data but do not test preprocessing take theirs from `write_tokenised`: the
files `preprocess(corpus, tokenizer, prefix, workers=1, sentences=...)` writes, byte for byte
(tests/data/test_preprocess.py compares them where `datasets` is installed), tokenised in this
process by preprocess's own encoder and written by its writer.
"""

from __future__ import annotations

import json
import os

from ptdp.data.indexed import IndexedDatasetWriter
from ptdp.data.preprocess import _Encoder, _meta
from ptdp.data.tokenizer import load_tokenizer


def write_tokenised(corpus: str | os.PathLike, tokenizer_path: str | os.PathLike,
                    prefix: str | os.PathLike, sentences: bool = False) -> str:
    """PREFIX.{bin,idx,ptdp.json} from the JSONL `corpus`'s "text" fields; returns PREFIX."""
    tok = load_tokenizer(tokenizer_path)
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    documents = _Encoder(tok, ["text"], sentences, append_eod=True)({"text": texts})["ids:text"]
    meta = _meta(tok, corpus, "text", sentences, append_eod=True, prepend_bos=False)
    with IndexedDatasetWriter(prefix, tok.vocab_size, meta) as writer:
        for sequences in documents:
            if sequences:   # as preprocess: a document that tokenises to nothing is skipped
                writer.add_document(sequences)
    return str(prefix)
