"""`ptdp preprocess`: JSONL (or text) documents -> tokenised indexed dataset (.bin + .idx).

Tokenisation runs in worker processes through Hugging Face `datasets` (`map(num_proc=N)`,
order preserved, so the output is identical for any worker count); writing is a single
sequential pass with a progress bar. Every document ends with the end-of-document token. With
`split_sentences=True` (BERT) each document is stored as a list of sentences so the BERT
dataset can form sentence pairs; the end-of-document token then ends the last sentence.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from ptdp.data.indexed import IndexedDatasetWriter
from ptdp.data.tokenizer import load_tokenizer

# A sentence ends at . ! or ? followed by whitespace and something that starts a sentence;
# paragraphs (blank lines) always end one. Good enough for prose; no model download needed.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]?\s+(?=[\"'(\[]?[A-Z0-9>])")
_PARAGRAPH = re.compile(r"\n\s*\n")


def split_sentences(text: str) -> list[str]:
    """Split text into sentences; line breaks inside a paragraph are kept as spaces."""
    sentences = []
    for paragraph in _PARAGRAPH.split(text):
        paragraph = " ".join(paragraph.split())
        sentences.extend(s for s in _SENTENCE_END.split(paragraph) if s)
    return sentences


class _Encoder:
    """Picklable batch function for `datasets.map`: loads the tokenizer once per worker."""

    def __init__(self, tokenizer_path: str, json_key: str, sentences: bool):
        self.tokenizer_path, self.json_key, self.sentences = tokenizer_path, json_key, sentences
        self._tok = None

    def __call__(self, batch: dict) -> dict:
        if self._tok is None:
            self._tok = load_tokenizer(self.tokenizer_path)
        eod = self._tok.eod_id
        out = []
        for text in batch[self.json_key]:
            pieces = split_sentences(text or "") if self.sentences else [text or ""]
            seqs = [ids for ids in self._tok.encode_batch(pieces) if ids]
            if seqs:
                seqs[-1].append(eod)
            out.append(seqs)
        return {"ids": out}


def _load_documents(input_path: Path, json_key: str, cache_dir: str, progress: bool):
    """Load JSONL (`json_key` field) or plain text (one document per line) as a Dataset."""
    try:
        import datasets
    except ImportError:
        raise ImportError("`ptdp preprocess` needs Hugging Face datasets: "
                          "pip install 'ptdp[data]' (or pip install datasets)") from None
    if not progress:
        datasets.disable_progress_bars()
    if not input_path.is_file():
        raise FileNotFoundError(f"input not found: {input_path}")
    if not _has_text(input_path):  # `datasets` fails on an empty file with a bare StopIteration
        raise ValueError(f"input {input_path} is empty: no documents to tokenise")
    builder = "json" if input_path.suffix in (".jsonl", ".json") else "text"
    ds = datasets.load_dataset(builder, data_files=str(input_path), split="train",
                               cache_dir=cache_dir)
    key = json_key if builder == "json" else "text"
    if key not in ds.column_names:
        raise ValueError(f"{input_path}: no '{key}' field (columns: {', '.join(ds.column_names)}); "
                         f"pass --json-key")
    return ds, key


def _has_text(path: Path) -> bool:
    """True if some line holds more than whitespace (stops at the first such line)."""
    with path.open("rb") as f:
        return any(line.strip() for line in f)


def preprocess(input_path: str | os.PathLike, tokenizer_path: str | os.PathLike,
               output_prefix: str | os.PathLike, workers: int = 1, json_key: str = "text",
               sentences: bool = False, progress: bool = True) -> dict:
    """Tokenise `input_path` into `{output_prefix}.bin/.idx`; returns a summary dict."""
    from tqdm import tqdm

    start = time.perf_counter()
    tok = load_tokenizer(tokenizer_path)
    _ = tok.eod_id  # fail now, not inside a worker, if the model has no end-of-document token
    cache_dir = tempfile.mkdtemp(prefix="ptdp-preprocess-")
    try:
        ds, key = _load_documents(Path(input_path), json_key, cache_dir, progress)
        encoded = ds.map(_Encoder(tok.path, key, sentences), batched=True, batch_size=256,
                         num_proc=workers if workers > 1 else None,
                         remove_columns=ds.column_names, desc="tokenising")
        meta = {"tokenizer": os.path.abspath(tok.path), "tokenizer_fingerprint": tok.fingerprint,
                "special_ids": tok.special_ids(), "sentences": bool(sentences),
                "source": os.path.abspath(input_path)}
        skipped = 0
        with IndexedDatasetWriter(output_prefix, tok.vocab_size, meta) as writer, \
                tqdm(total=len(encoded), desc="writing", unit="doc", disable=not progress) as bar:
            for batch in encoded.iter(batch_size=1024):
                for seqs in batch["ids"]:
                    if seqs:
                        writer.add_document(seqs)
                    else:
                        skipped += 1  # empty text: a document of only <eod> teaches nothing
                bar.update(len(batch["ids"]))
            documents = writer.num_documents
            if documents == 0:  # raised inside the writer: no .bin/.idx is left behind
                raise ValueError(f"input {input_path}: every document is empty, nothing to write")
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return {"documents": documents, "skipped": skipped, "output_prefix": str(output_prefix),
            "seconds": time.perf_counter() - start}
