"""Prompts and end ids as `transformers` makes them, so `ptdp generate` continues the prompt that
`model.generate(**tokenizer(prompt), do_sample=False)` continues and stops where it stops.

* The prompt: a Hugging Face tokenizer (tokenizer.json) adds its own special tokens, as
  `tokenizer(prompt)` does: Llama 3's `<|begin_of_text|>`, TinyLlama's and Mistral's `<s>`, none
  for GPT-2's. With `transformers` installed and a tokenizer_config.json beside the
  tokenizer.json, transformers itself loads the files (its tokenizer classes may rebuild the
  pipeline from tokenizer_config.json's add_bos_token); otherwise the tokenizer.json's own
  post-processor adds them. ptdp's sentencepiece tokenizers add nothing (GPT data has no BOS).
* `chat=True`: the tokenizer's chat template (chat_template.jinja, or tokenizer_config.json's
  chat_template) applied to one user message with the generation prompt, as
  `tokenizer.apply_chat_template(..., add_generation_prompt=True)`.
* End ids: generation_config.json's eos_token_id (an id or a list: Llama 3 Instruct ends turns
  with `<|eot_id|>`), the tokenizer's end-of-text token, and any the caller adds (`--stop`).

The checkpoint keeps generation_config.json and chat_template.jinja beside its tokenizer.json
(ptdp/data/tokenizer.py `hf_tokenizer_files`; ptdp/checkpoint/save.py copies them), so a model
converted from Hugging Face generates as it did there.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from functools import cached_property
from pathlib import Path

from ptdp.data.tokenizer import (EOD, HF_CHAT_TEMPLATE, HF_GENERATION_CONFIG,
                                 HF_TOKENIZER_CONFIG, hf_tokenizer_files, is_hf_tokenizer)


class PromptError(ValueError):
    """A prompt that cannot be made as asked (no chat template, ...); one line."""


class Prompts:
    """Encodes prompts and lists end ids for the tokenizer at `path` (`tok`: it, loaded)."""

    def __init__(self, path: str | os.PathLike, tok):
        self.path, self.tok = str(path), tok
        self.files = hf_tokenizer_files(path) if is_hf_tokenizer(path) else {}

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """The prompt's token ids, special tokens included (see the module docstring)."""
        if chat:
            return self._chat(text)
        if not self.files:
            return self.tok.encode(text)
        if self._transformers is not None:
            return list(self._transformers(text)["input_ids"])
        return self.tok.backend.encode(text, add_special_tokens=True).ids

    def _chat(self, text: str) -> list[int]:
        if not self.files:
            raise PromptError(f"--chat needs a Hugging Face tokenizer with a chat template; "
                              f"{self.path} is a sentencepiece model")
        hf = self._transformers
        if hf is None:
            raise PromptError("--chat needs transformers (pip install 'ptdp[hf]') and a "
                              f"{HF_TOKENIZER_CONFIG} beside {self.path}")
        if not getattr(hf, "chat_template", None):
            raise PromptError(f"--chat: the tokenizer {self.path} has no chat template "
                              f"({HF_CHAT_TEMPLATE}, or chat_template in {HF_TOKENIZER_CONFIG})")
        out = hf.apply_chat_template([{"role": "user", "content": text}],
                                     add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    @cached_property
    def _transformers(self):
        """transformers' own tokenizer of these files, or None (not installed, or no
        tokenizer_config.json to say which class)."""
        if HF_TOKENIZER_CONFIG not in self.files:
            return None
        try:
            from transformers import AutoTokenizer
            from transformers.utils import logging
        except ImportError:
            return None
        logging.set_verbosity_error()   # ptdp's own lines say what is wrong
        with tempfile.TemporaryDirectory(prefix="ptdp-prompts-") as tmp:
            for name, source in self.files.items():   # by their usual names, nothing else
                shutil.copyfile(source, Path(tmp) / name)
            return AutoTokenizer.from_pretrained(tmp)

    def end_ids(self, extra=()) -> list[int]:
        """Every id that ends a generation: generation_config.json's, the tokenizer's
        end-of-text, then `extra`; each once, in that order."""
        ids = []
        if HF_GENERATION_CONFIG in self.files:
            ids += _listed(json.loads(self.files[HF_GENERATION_CONFIG].read_text(
                encoding="utf-8")).get("eos_token_id"))
        eod = self.tok.special_ids().get(EOD)
        ids += [] if eod is None else [eod]
        ids += list(extra)
        return list(dict.fromkeys(int(i) for i in ids))


def _listed(value) -> list[int]:
    """An eos_token_id field (null, an id or a list of ids) as a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
