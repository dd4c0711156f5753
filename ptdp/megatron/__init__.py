"""Megatron-LM interoperability: its checkpoints and its command-line arguments.

Megatron's indexed datasets need no translation: `ptdp/data/indexed.py` reads and writes
that format natively. What users bring from Megatron-LM and what it maps to is listed in
docs/migration.md.
"""
