"""Hugging Face `transformers` both ways: `ptdp convert` (ptdp/hf/convert.py) maps the weights
(ptdp/hf/mapping.py) and the sentencepiece tokenizer (ptdp/hf/tokenizer.py)."""
