"""Checkpoint formats: Hugging Face folders (one adapter per architecture family), GGUF, tokenizers, weights, export."""
