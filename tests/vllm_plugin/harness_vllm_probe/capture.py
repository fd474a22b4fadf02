"""vLLM's adapter of the hidden-state probe (harness_probe_capture): per-layer hidden states and per-head
attention outputs at the harness's probe positions, captured by forward hooks in each vLLM worker, for
localization on vLLM (the harness's hidden.{i} / attn.{i}).

Active when the probe folder (HARNESS_VLLM_PROBE_DIR) holds the harness's `capture-cases.json`. The model
runner (vLLM's GPUModelRunner, which its CPU runner extends) is wrapped: `execute_model` keeps the step's
scheduler output (which requests the step runs and how many tokens each), `_model_forward` finds the probe rows
in the flattened batch (the requests in `input_batch.req_ids` order, each `num_scheduled_tokens` long; their
positions are the model's `positions`) of every request whose prompt is one of the cases' sequences (the
scoring request: vLLM never serves a prompt_logprobs request from its prefix cache), and the first forward puts
the hooks on the token embedding, every decoder layer (the ModuleList whose members hold an Attention) and each
layer's Attention. Hooks fire only when modules run eagerly (the template passes --enforce-eager).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

from harness_probe_capture import Capture

_CAPTURE: Capture | None = None


def _rank() -> int:
    from vllm.distributed import parallel_state as ps

    return int(ps.get_tensor_model_parallel_rank())


def _attention_types() -> tuple[type, ...]:
    """vLLM's attention layers: Attention, and MLAAttention (multi-head latent attention: its output is each local
    head's value-space output, [T, heads * v_head_dim], as Attention's is)."""
    from vllm.model_executor.layers.attention.attention import Attention

    try:
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    except ImportError:  # a build without MLA
        return (Attention,)
    return (Attention, MLAAttention)


def _decoder_layers(model: Any) -> tuple[Any, list[Any]]:
    """(the token embedding, the decoder layers in order) of a vLLM model: the ModuleList whose members each
    hold an attention layer, and the first vocab-parallel embedding that is not the LM head."""
    from torch import nn
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embed = next((m for _, m in model.named_modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)), None)
    if embed is None:
        raise RuntimeError("no token embedding (VocabParallelEmbedding) found in the model")
    attention = _attention_types()
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(
                _linear_mixer(layer) is not None or any(isinstance(sub, attention) for sub in layer.modules())
                for layer in module):
            return embed, list(module)
    raise RuntimeError("no ModuleList of decoder layers with attention found in the model")


def _linear_mixer(layer: Any) -> Any:
    """A hybrid decoder layer's linear-attention mixer (Qwen3-Next's Gated DeltaNet: `linear_attn`), else None."""
    return getattr(layer, "linear_attn", None)


def _zeros_like_heads(capture: Capture, layer: int, heads: int, head_dim: int) -> Callable[..., None]:
    """A linear-attention layer's per-head capture: zeros [T, heads * head_dim] (its output is no per-head
    attention; the embedded engine records zeros too where heads x head_dim is not the hidden size)."""

    def hook(_m: Any, args: Any, kwargs: Any, _out: Any) -> None:
        stream = kwargs.get("hidden_states", args[0] if args else None)
        if stream is not None:
            capture.on_attention(layer, stream.new_zeros(stream.shape[0], heads * head_dim), heads)

    return hook


def _hook(capture: Capture, model: Any) -> None:
    attention = _attention_types()
    embed, layers = _decoder_layers(model)
    capture.layers = len(layers)
    embed.register_forward_hook(lambda _m, _i, out: capture.on_hidden(0, out))
    full = next(m for layer in layers for m in layer.modules() if isinstance(m, attention))
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda _m, _i, out, i=i: capture.on_layer(i, out))
        mixer = _linear_mixer(layer)
        if mixer is not None:
            mixer.register_forward_hook(_zeros_like_heads(capture, i, int(full.num_heads), int(full.head_size)),
                                        with_kwargs=True)
            continue
        attn = next(m for m in layer.modules() if isinstance(m, attention))
        attn.register_forward_hook(lambda _m, _i, out, i=i, n=int(attn.num_heads): capture.on_attention(i, out, n))
    capture.hooked.add(id(model))


def _plan(capture: Capture, runner: Any, scheduler_output: Any, positions: Any) -> None:
    """Which flat tokens of this forward are probe positions of a case's scoring request."""
    by_sequence: dict[tuple[int, ...], list[tuple[int, tuple[int, ...]]]] = {}
    for case, (sequence, probes) in capture.cases.items():
        by_sequence.setdefault(sequence, []).append((case, probes))
    rows: list[int] = []
    labels: list[tuple[Any, int, int]] = []
    if by_sequence and positions is not None and positions.dim() == 1:
        offset = 0
        counts = scheduler_output.num_scheduled_tokens
        for req_id in runner.input_batch.req_ids:  # the batch: each request's scheduled tokens, in this order
            count = int(counts.get(req_id, 0))
            prompt = getattr(runner.requests.get(req_id), "prompt_token_ids", None)
            wanted = by_sequence.get(tuple(prompt)) if prompt else None
            if wanted and count:
                for j, pos in enumerate(positions[offset:offset + count].tolist()):
                    for case, probes in wanted:
                        if pos in probes:
                            rows.append(offset + j)
                            labels.append((req_id, case, pos))
            offset += count
    capture.begin(rows, labels)


def _capturing_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        capture, scheduled = _CAPTURE, getattr(self, "_harness_scheduled", None)
        if capture is None or capture.failed or scheduled is None:
            return forward(self, *args, **kwargs)
        try:
            model = self.get_model()
            if id(model) not in capture.hooked:
                _hook(capture, model)
            _plan(capture, self, scheduled, kwargs.get("positions", args[1] if len(args) > 1 else None))
        except Exception as exc:  # the probe never breaks serving
            capture.fail(exc)
        try:
            return forward(self, *args, **kwargs)
        finally:
            capture.end()

    model_forward.__harness_probe__ = True  # type: ignore[attr-defined]
    return model_forward


def _remembering(execute: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(execute)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._harness_scheduled = scheduler_output  # which requests' tokens the forward holds, and how many
        try:
            return execute(self, scheduler_output, *args, **kwargs)
        finally:
            self._harness_scheduled = None

    execute_model.__harness_probe__ = True  # type: ignore[attr-defined]
    return execute_model


def register(folder: str) -> None:
    """Wrap the model runner in this process (vLLM calls the probe plugin in every process)."""
    global _CAPTURE
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner._model_forward, "__harness_probe__", False):
        return
    _CAPTURE = Capture(folder=Path(folder), rank=_rank)
    GPUModelRunner.execute_model = _remembering(GPUModelRunner.execute_model)
    GPUModelRunner._model_forward = _capturing_forward(GPUModelRunner._model_forward)
