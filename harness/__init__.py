"""Multi-GPU correctness and accuracy regression harness for LLM inference."""

__version__ = "0.1.0"
