"""Hugging Face checkpoints, one adapter per architecture family (names, shapes and config, both directions)."""
