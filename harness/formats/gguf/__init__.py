"""GGUF files: the metadata reader and the per-file conversion cache."""
