"""`harness serve`: the embedded engine behind an HTTP server, at any topology.

Rank 0 runs the HTTP server (FastAPI + uvicorn) and the engine loop; the other ranks follow in
lockstep, receiving each batch of requests through the engine's ParallelState. Two request dialects:
vLLM's OpenAI-compatible /v1/completions (token-id prompts, prompt_logprobs, logprobs) and SGLang's
native /generate (input_ids, return_logprob, logprob_start_len, top_logprobs_num).
"""
