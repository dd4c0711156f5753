"""ptdp: pipeline, tensor and data parallel training of GPT and BERT models."""

__version__ = "0.1.0"
