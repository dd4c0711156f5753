"""ptdp's sentencepiece model as a Hugging Face fast tokenizer (tokenizer.json).

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
from types import SimpleNamespace

from ptdp.data.tokenizer import CLS, EOD, MASK, PAD, SEP, Tokenizer


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
    names = {EOD: "eos_token", CLS: "cls_token", SEP: "sep_token", MASK: "mask_token",
             PAD: "pad_token"}
    kwargs = {names[token]: token for token in special}
    if arch == "bert" and CLS in special and SEP in special:
        tok.post_processor = TemplateProcessing(
            single=f"{CLS} $A {SEP}", pair=f"{CLS} $A:0 {SEP}:0 $B:1 {SEP}:1",
            special_tokens=[(CLS, special[CLS]), (SEP, special[SEP])])
    if arch == "bert":
        kwargs["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=ours.unk_piece,
                                   model_max_length=max_length, **kwargs)
    fast.save_pretrained(str(out_dir))
