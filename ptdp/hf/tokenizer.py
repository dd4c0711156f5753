"""The tokenizer travels with the model, both ways.

ptdp -> HF: a checkpoint's Hugging Face tokenizer (tokenizer.json, which a checkpoint converted
from HF holds) is copied back as it is, with its tokenizer_config.json; a sentencepiece model is
converted (below) and also kept as `ptdp_tokenizer.model`. HF -> ptdp: that
`ptdp_tokenizer.model` when there is one (the original), else the directory's tokenizer.json,
becomes the checkpoint's tokenizer (ptdp/checkpoint/save.py copies it).

ptdp's sentencepiece model as a Hugging Face fast tokenizer (tokenizer.json):

Built from the model file with `tokenizers` and the pieces of transformers' own sentencepiece
converter (its normalizer and pre-tokenizer read the model's precompiled normalisation
rules), so `AutoTokenizer.from_pretrained(dir)` needs no sentencepiece and no other file:
  * BPE over the sentencepiece pieces, merges ordered by piece score, byte fallback on (ptdp
    trains with byte_fallback, so no text is <unk>);
  * the control symbols (<eod>, [CLS], [SEP], [MASK], [PAD]) are special tokens. One
    difference: sentencepiece never produces them from text, while the HF tokenizer matches
    a literal "[MASK]" in the text as the special token (what fill-mask pipelines expect);
  * decoding: "▁" back to spaces, byte pieces back to bytes, the leading space dropped.
BERT tokenizers add "[CLS] A [SEP]" (pairs: "[CLS] A [SEP] B [SEP]", token types 0/1) when
called with add_special_tokens=True, as ptdp's BERT data does; GPT tokenizers add nothing.
Requires `protobuf` to read the model file (in the `hf` extra).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

from ptdp.config.models import Samples, model_family
from ptdp.data.tokenizer import (CLS, HF_ROLE_KEYS, HF_TOKENIZER_CONFIG, HF_TOKENIZER_FILE, SEP,
                                 Tokenizer, hf_tokenizer_files, is_hf_tokenizer, load_tokenizer)

SPM_FILE = "ptdp_tokenizer.model"   # the original sentencepiece model, beside its conversion


def _converted(model_file: str):
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import SpmConverter
    from transformers.tokenization_utils_base import generate_merges

    class Converter(SpmConverter):
        handle_byte_fallback = True

        def tokenizer(self, proto):
            if proto.trainer_spec.model_type != 2:
                raise ValueError(f"{model_file}: only BPE sentencepiece models convert (ptdp "
                                 f"tokenizer train --model-type bpe, the default)")
            scores = [(p.piece, p.score) for p in proto.pieces]
            vocab = {piece: i for i, (piece, _) in enumerate(scores)}
            tok = HFTokenizer(BPE(vocab, generate_merges(vocab, scores),
                                  unk_token=proto.trainer_spec.unk_piece, fuse_unk=True,
                                  byte_fallback=proto.trainer_spec.byte_fallback, dropout=None))
            tok.add_tokens([AddedToken(p.piece, normalized=False, special=p.type == 3)
                            for p in proto.pieces if p.type in (3, 4)])  # control, user-defined
            return tok

        def decoder(self, replacement, add_prefix_space):
            return decoders.Sequence([decoders.Replace(replacement, " "), decoders.ByteFallback(),
                                      decoders.Fuse(), decoders.Strip(content=" ", left=1, right=0)])

    return Converter(SimpleNamespace(vocab_file=model_file)).converted()


def save_hf_tokenizer(model_file: str | os.PathLike, out_dir: str | os.PathLike, arch: str,
                      max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json for `model_file` into `out_dir`."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    ours = Tokenizer(model_file)
    special = ours.special_ids()
    tok = _converted(str(model_file))
    kwargs = {HF_ROLE_KEYS[token]: token for token in special if token in HF_ROLE_KEYS}
    pairs = model_family(arch).samples is Samples.SENTENCE_PAIRS   # [CLS] A [SEP] B [SEP]
    if pairs and CLS in special and SEP in special:
        tok.post_processor = TemplateProcessing(
            single=f"{CLS} $A {SEP}", pair=f"{CLS} $A:0 {SEP}:0 $B:1 {SEP}:1",
            special_tokens=[(CLS, special[CLS]), (SEP, special[SEP])])
    if pairs:
        kwargs["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=ours.unk_piece,
                                   model_max_length=max_length, **kwargs)
    fast.save_pretrained(str(out_dir))


def write_tokenizer(path: str | os.PathLike, out_dir: str | os.PathLike, arch: str,
                    max_length: int) -> None:
    """A checkpoint's tokenizer (`path`: sentencepiece or tokenizer.json) into an HF directory."""
    out_dir = Path(out_dir)
    if not is_hf_tokenizer(path):
        save_hf_tokenizer(path, out_dir, arch, max_length)
        shutil.copyfile(path, out_dir / SPM_FILE)
        return
    files = hf_tokenizer_files(path)
    if HF_TOKENIZER_CONFIG not in files:   # name the special tokens for AutoTokenizer
        from transformers import PreTrainedTokenizerFast
        tok = load_tokenizer(path)
        roles = {HF_ROLE_KEYS[role]: token for role, token in tok.special_tokens().items()}
        PreTrainedTokenizerFast(tokenizer_file=str(files[HF_TOKENIZER_FILE]),
                                model_max_length=max_length, **roles).save_pretrained(str(out_dir))
    for name, source in files.items():    # the original bytes, not a re-serialisation
        shutil.copyfile(source, out_dir / name)


def directory_tokenizer(hf_dir: str | os.PathLike) -> Path | None:
    """The tokenizer an HF model directory gives the checkpoint: the original sentencepiece
    model ptdp left there, else its tokenizer.json, else None."""
    for name in (SPM_FILE, HF_TOKENIZER_FILE):
        if (Path(hf_dir) / name).is_file():
            return Path(hf_dir) / name
    return None
