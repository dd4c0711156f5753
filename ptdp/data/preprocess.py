"""`ptdp preprocess`: JSONL (or text) documents -> tokenised indexed datasets, like
Megatron-LM's `preprocess_data.py`.

One output per JSON key (`json_keys`): Megatron's `.bin/.idx` pair plus ptdp's sidecar
(ptdp/data/indexed.py). Names are Megatron's, `{prefix}_{key}_{document|sentence}`, when
`megatron_names` is set (the command line sets it unless ptdp's own `--json-key` is given), else
`{prefix}` for one key and `{prefix}_{key}` for several.
Tokenisation runs in worker processes through Hugging Face `datasets` (`map(num_proc=N)`,
order preserved, so the output is identical for any worker count); writing is a single
sequential pass with a progress bar.

Differences from Megatron's tool, on purpose: the end-of-document token is appended by default
(`append_eod=True`; Megatron appends it only with `--append-eod`); a document whose text
tokenises to nothing is skipped (Megatron stores it as a document of no sequence); sentences
are split by the rule below, not by NLTK's punkt models (no download).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from ptdp.data.indexed import IndexedDatasetWriter, describe, read_index_header
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


def output_prefix_for(prefix: str | os.PathLike, key: str, keys: list[str], sentences: bool,
                      megatron_names: bool) -> str:
    """Where the dataset of JSON field `key` goes (see the module docstring)."""
    if megatron_names:
        return f"{prefix}_{key}_{'sentence' if sentences else 'document'}"
    return str(prefix) if len(keys) == 1 else f"{prefix}_{key}"


class _Encoder:
    """Picklable batch function for `datasets.map`: token ids of every key, one column each.

    A field holding a list of strings is taken as the document's sentences, as Megatron
    does with the output of its sentence-splitting pass.
    """

    def __init__(self, tokenizer, keys: list[str], sentences: bool, append_eod: bool,
                 prepend_bos: bool = False):
        self.tokenizer, self.keys = tokenizer, keys
        self.sentences, self.append_eod, self.prepend_bos = sentences, append_eod, prepend_bos

    def _pieces(self, text) -> list[str]:
        if isinstance(text, list):
            return [str(t) for t in text]
        return split_sentences(text or "") if self.sentences else [text or ""]

    def __call__(self, batch: dict) -> dict:
        out = {}
        for key in self.keys:
            column = []
            for text in batch[key]:
                seqs = [ids for ids in self.tokenizer.encode_batch(self._pieces(text)) if ids]
                if self.prepend_bos:   # Megatron's Llama2Tokenizer: <s> before every sequence
                    seqs = [[self.tokenizer.bos_id] + ids for ids in seqs]
                if seqs and self.append_eod:
                    seqs[-1].append(self.tokenizer.eod_id)
                column.append(seqs)
            out[f"ids:{key}"] = column
        return out


def _load_documents(input_path: Path, keys: list[str], cache_dir: str, progress: bool):
    """Load JSONL (the `keys` fields) or plain text (one document per line) as a Dataset;
    returns it and the columns holding the keys' texts."""
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
    _check_lines(input_path, keys if builder == "json" and input_path.suffix == ".jsonl" else [])
    ds = datasets.load_dataset(builder, data_files=str(input_path), split="train",
                               cache_dir=cache_dir)
    if builder == "text":
        return ds, ["text"]
    missing = [k for k in keys if k not in ds.column_names]
    if missing:
        raise ValueError(f"{input_path}: no '{missing[0]}' field (columns: "
                         f"{', '.join(ds.column_names)}); pass --json-keys")
    return ds, keys


def _check_lines(path: Path, keys: list[str]) -> None:
    """One pass over the input before `datasets` reads it, so that a bad line is one error
    naming the file and line (`datasets` reports it in a 70-line traceback, or not at all):
    every line is UTF-8, and with `keys` (JSONL) a JSON object whose `keys` fields are text
    (a string, or a list of strings)."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{number}: not UTF-8 (byte {err.start} of the line: "
                                 f"{raw[err.start:err.start + 1]!r}); re-encode the file as "
                                 f"UTF-8") from None
            if not keys or not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON object ({err.msg} at column "
                                 f"{err.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: a JSON {type(record).__name__}, not an object")
            for key in keys:
                text = record.get(key)
                if text is not None and not isinstance(text, str) and not (
                        isinstance(text, list) and all(isinstance(t, str) for t in text)):
                    raise ValueError(f"{path}:{number}: field '{key}' is {json.dumps(text)[:40]}, "
                                     f"not text (a string or a list of strings)")


def _has_text(path: Path) -> bool:
    """True if some line holds more than whitespace (stops at the first such line)."""
    with path.open("rb") as f:
        return any(line.strip() for line in f)


def _tokenizer_meta(tok) -> dict:
    """What the sidecar records of the tokenizer (checked against data.tokenizer later)."""
    meta = {"tokenizer": os.path.abspath(tok.path), "tokenizer_fingerprint": tok.fingerprint,
            "special_ids": tok.special_ids()}
    for name in ("merge_file", "lowercase"):   # how a vocabulary-file tokenizer was built
        if getattr(tok, name, None) is not None:
            meta[name] = os.path.abspath(tok.merge_file) if name == "merge_file" else tok.lowercase
    return meta


def _meta(tok, input_path, key: str, sentences: bool, append_eod: bool,
          prepend_bos: bool) -> dict:
    return {**_tokenizer_meta(tok), "sentences": bool(sentences),
            "source": os.path.abspath(input_path), "json_key": key,
            "append_eod": bool(append_eod), "prepend_bos": bool(prepend_bos)}


def preprocess(input_path: str | os.PathLike, tokenizer_path: str | os.PathLike,
               output_prefix: str | os.PathLike, workers: int = 1, json_key: str = "text",
               sentences: bool = False, progress: bool = True, *,
               json_keys: list[str] | None = None, append_eod: bool = True,
               megatron_names: bool = False, merge_file: str | None = None,
               lowercase: bool | None = None, prepend_bos: bool = False) -> dict:
    """Tokenise `input_path` into one dataset per JSON key (`json_keys`, else `json_key`);
    returns a summary dict (`outputs`: the prefixes written). `prepend_bos` starts every
    sequence with the tokenizer's <s>, as Megatron's Llama2Tokenizer does."""
    from tqdm import tqdm

    start = time.perf_counter()
    tok = load_tokenizer(tokenizer_path, merge_file, lowercase)
    if append_eod:
        _ = tok.eod_id  # fail now, not inside a worker, if the tokenizer has no end-of-document
    if prepend_bos:
        _ = tok.bos_id
    cache_dir = tempfile.mkdtemp(prefix="ptdp-preprocess-")
    try:
        ds, keys = _load_documents(Path(input_path), list(json_keys or [json_key]), cache_dir,
                                   progress)
        encoded = ds.map(_Encoder(tok, keys, sentences, append_eod, prepend_bos), batched=True,
                         batch_size=256, num_proc=workers if workers > 1 else None,
                         remove_columns=ds.column_names, desc="tokenising")
        outputs = {key: output_prefix_for(output_prefix, key, keys, sentences, megatron_names)
                   for key in keys}
        metas = {key: _meta(tok, input_path, key, sentences, append_eod, prepend_bos)
                 for key in keys}
        counts = _write(encoded, tok, outputs, metas, input_path, progress, tqdm)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    first = counts[keys[0]]
    return {"documents": first["documents"], "skipped": first["skipped"],
            "output_prefix": outputs[keys[0]], "outputs": list(outputs.values()),
            "per_key": counts, "seconds": time.perf_counter() - start}


def _write(encoded, tok, outputs: dict, metas: dict, input_path, progress, tqdm) -> dict:
    """One sequential pass writing every key's dataset. Each is published when complete (a
    failure while writing publishes none; one in a later key's publishing leaves the earlier
    keys' datasets in place)."""
    counts = {key: {"documents": 0, "skipped": 0} for key in outputs}
    with ExitStack() as stack:
        writers = {key: stack.enter_context(IndexedDatasetWriter(prefix, tok.vocab_size, metas[key]))
                   for key, prefix in outputs.items()}
        bar = stack.enter_context(tqdm(total=len(encoded), desc="writing", unit="doc",
                                       disable=not progress))
        for batch in encoded.iter(batch_size=1024):
            for key, writer in writers.items():
                for seqs in batch[f"ids:{key}"]:
                    if seqs:
                        writer.add_document(seqs)
                    else:   # empty text: a document of nothing (or only <eod>) teaches nothing
                        counts[key]["skipped"] += 1
            bar.update(len(next(iter(batch.values()))))
        for key, writer in writers.items():
            counts[key]["documents"] = writer.num_documents
            if writer.num_documents == 0:  # raised inside the writers: nothing is left behind
                raise ValueError(f"input {input_path}: every document is empty, nothing to "
                                 f"write (field '{key}')")
    return counts


def describe_dataset(prefix: str | os.PathLike, tokenizer_path: str | os.PathLike,
                     sentences: bool | None = None, merge_file: str | None = None,
                     lowercase: bool | None = None) -> Path:
    """Write the sidecar of a pair Megatron's preprocess_data.py made with this
    tokenizer, so that ptdp checks it like its own (vocabulary, special ids for BERT)."""
    tok = load_tokenizer(tokenizer_path, merge_file, lowercase)
    header = read_index_header(prefix, sidecar=False)
    meta = {**_tokenizer_meta(tok),
            "sentences": header.meta["sentences"] if sentences is None else bool(sentences),
            "source": "described by `ptdp preprocess --describe`"}
    return describe(prefix, tok.vocab_size, meta)
