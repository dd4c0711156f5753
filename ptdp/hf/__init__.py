"""Hugging Face `transformers` both ways: `ptdp convert` (ptdp/hf/convert.py) through one module
per model family (gpt2.py, megatron_bert.py, llama.py with Mistral, Qwen2 and Qwen3, gemma.py,
phi3.py, moe.py: its config mapping and its state-dict adapter, on the interface of base.py),
found by model_type or by ptdp's block options (registry.py); the tokenizer travels with the
model (tokenizer.py)."""
