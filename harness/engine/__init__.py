"""The embedded reference engine: a pure-PyTorch Llama/Qwen-style decoder with TP, DCP and a paged KV cache."""
