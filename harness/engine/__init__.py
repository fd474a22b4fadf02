"""The embedded reference engine: a pure-PyTorch Llama/Qwen-style decoder with TP, DCP and a paged KV cache."""

ENGINE_VERSION = "1"  # raised when the engine's artifacts change meaning (recorded in manifests)
