"""Per-layer hidden states and per-head attention outputs at the harness's probe positions, captured by
forward hooks in each vLLM worker, for localization on vLLM (the harness's hidden.{i} / attn.{i}).

Active when the probe folder (HARNESS_VLLM_PROBE_DIR) holds `capture-cases.json`, which the harness writes
before it starts the server: per case the teacher-forced token ids it will score and the probe positions.
A request whose prompt is one of those sequences is a case; at each of its probe positions the worker keeps
  - the residual stream after the embedding and after every decoder layer ([L+1, H]; a vLLM decoder layer
    returns (hidden, residual) with the residual add deferred to the next fused norm, so the stream is their
    sum),
  - the output of every layer's attention (before o_proj), this rank's own Q heads ([L, Q heads, head dim]).
Hooks copy the probe rows out at once (the next layer's fused add-norm overwrites its inputs in place). When
every probe position of a case has been seen (its prompt may come in chunks), the worker writes
`capture/rank<R>.case<I>.safetensors`: hidden [L+1, P, H], attn [L, P, local Q heads, head dim] (float32) and
positions [P]. Anything that goes wrong is written to `capture/rank<R>.error.json` and ends the capture, never
the serving. Hooks fire only when modules run eagerly (the template passes --enforce-eager).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

CASES_FILE = "capture-cases.json"
CAPTURE_DIR = "capture"


@dataclass
class _Forward:
    """The probe rows of the forward pass running now, and what the hooks copied out of them."""

    rows: Any  # torch.Tensor [R] int64: flat token indices of the batch
    labels: list[tuple[int, int]]  # (case, position) of each row
    hidden: dict[int, Any] = field(default_factory=dict)  # hidden index (0: embedding) -> [R, H]
    attn: dict[int, Any] = field(default_factory=dict)  # layer -> [R, local Q heads, head dim]

    def take(self, t: Any) -> Any:
        """The probe rows of `t` [N, ...], copied (and cloned: in-place kernels reuse `t`) as float32."""
        rows = self.rows if self.rows.device == t.device else self.rows.to(t.device)
        return t.detach().index_select(0, rows).clone().float().cpu()


@dataclass
class _State:
    folder: Path
    cases: dict[tuple[int, ...], list[tuple[int, frozenset[int]]]] | None = None  # sequence -> [(case, probes)]
    probes: dict[int, tuple[int, ...]] = field(default_factory=dict)  # case -> its probe positions
    hooked: set[int] = field(default_factory=set)  # id() of the models hooks were put on
    layers: int = 0
    forward: _Forward | None = None
    # case -> position -> (hidden [L+1, H], attn [L, heads, head dim])
    pending: dict[int, dict[int, tuple[Any, Any]]] = field(default_factory=dict)
    failed: bool = False


_STATE: _State | None = None


def _load_cases(state: _State) -> dict[tuple[int, ...], list[tuple[int, frozenset[int]]]]:
    if state.cases is None:
        path = state.folder / CASES_FILE
        data = json.loads(path.read_text()) if path.is_file() else []
        cases: dict[tuple[int, ...], list[tuple[int, frozenset[int]]]] = {}
        for entry in data:
            cases.setdefault(tuple(int(t) for t in entry["sequence_ids"]), []).append(
                (int(entry["case"]), frozenset(int(p) for p in entry["positions"])))
            state.probes[int(entry["case"])] = tuple(sorted(int(p) for p in entry["positions"]))
        state.cases = cases
    return state.cases


def _rank() -> int:
    from vllm.distributed import parallel_state as ps

    return int(ps.get_tensor_model_parallel_rank())


def _fail(state: _State, exc: BaseException) -> None:
    import traceback

    state.failed, state.forward = True, None
    out = state.folder / CAPTURE_DIR
    out.mkdir(parents=True, exist_ok=True)
    try:
        rank = _rank()
    except Exception:
        rank = 0
    (out / f"rank{rank}.error.json").write_text(json.dumps({"error": repr(exc), "traceback": traceback.format_exc()}))


def _decoder_layers(model: Any) -> tuple[Any, list[Any]]:
    """(the token embedding, the decoder layers in order) of a vLLM model: the ModuleList whose members each
    hold an attention layer, and the first vocab-parallel embedding that is not the LM head."""
    from torch import nn
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embed = next((m for _, m in model.named_modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)), None)
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(
                any(isinstance(sub, Attention) for sub in layer.modules()) for layer in module):
            return embed, list(module)
    raise RuntimeError("no ModuleList of decoder layers with attention found in the model")


def _hook(state: _State, model: Any) -> None:
    from vllm.model_executor.layers.attention.attention import Attention

    embed, layers = _decoder_layers(model)
    if embed is None:
        raise RuntimeError("no token embedding (VocabParallelEmbedding) found in the model")
    state.layers = len(layers)

    def on_embed(_module: Any, _inputs: Any, output: Any) -> None:
        if state.forward is not None:
            state.forward.hidden[0] = state.forward.take(output)

    def on_layer(index: int) -> Callable[..., None]:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            if state.forward is None:
                return
            if isinstance(output, (tuple, list)):
                hidden, residual = output[0], output[1] if len(output) > 1 else None
                stream = state.forward.take(hidden)
                if residual is not None:
                    stream = stream + state.forward.take(residual)  # the deferred residual add
            else:
                stream = state.forward.take(output)
            state.forward.hidden[index + 1] = stream
        return hook

    def on_attn(index: int, attn: Any) -> Callable[..., None]:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            if state.forward is not None:
                rows = state.forward.take(output)  # [R, heads * head dim]
                state.forward.attn[index] = rows.view(rows.shape[0], int(attn.num_heads), -1)  # [R, heads, hd]
        return hook

    embed.register_forward_hook(on_embed)
    for i, layer in enumerate(layers):
        layer.register_forward_hook(on_layer(i))
        attn = next(m for m in layer.modules() if isinstance(m, Attention))
        attn.register_forward_hook(on_attn(i, attn))
    state.hooked.add(id(model))


def _plan(state: _State, runner: Any, scheduler_output: Any, positions: Any) -> _Forward | None:
    """Which flat tokens of this forward are probe positions of a case (None: none)."""
    import torch

    cases = _load_cases(state)
    if not cases or positions is None or positions.dim() != 1:
        return None
    rows: list[int] = []
    labels: list[tuple[int, int]] = []
    offset = 0
    counts = scheduler_output.num_scheduled_tokens
    for req_id in runner.input_batch.req_ids:  # the batch's tokens: each request's scheduled tokens in this order
        count = int(counts.get(req_id, 0))
        request = runner.requests.get(req_id)
        prompt = getattr(request, "prompt_token_ids", None)
        wanted = cases.get(tuple(prompt)) if prompt else None
        if wanted and count:
            for j, pos in enumerate(positions[offset:offset + count].tolist()):
                if pos < len(prompt):
                    labels += [(case, pos) for case, probes in wanted if pos in probes]
                    rows += [offset + j] * sum(pos in probes for _, probes in wanted)
        offset += count
    if not rows:
        return None
    return _Forward(rows=torch.tensor(rows, dtype=torch.int64), labels=labels)


def _finish(state: _State, forward: _Forward) -> None:
    """Keep the copied rows per (case, position); write every case whose probe positions are all seen."""
    import torch
    from safetensors.torch import save_file

    expected = list(range(state.layers + 1))
    if sorted(forward.hidden) != expected or sorted(forward.attn) != expected[:-1]:
        raise RuntimeError(f"hooks captured hidden indices {sorted(forward.hidden)} and attention layers "
                           f"{sorted(forward.attn)} of {state.layers} layers (does the model run eagerly?)")
    done = set()
    for k, (case, pos) in enumerate(forward.labels):
        hidden = torch.stack([forward.hidden[i][k] for i in expected])  # [L+1, H]
        attn = torch.stack([forward.attn[i][k] for i in expected[:-1]])  # [L, heads, hd]
        state.pending.setdefault(case, {})[pos] = (hidden, attn)
        done.add(case)
    rank = _rank()
    out = state.folder / CAPTURE_DIR
    for case in sorted(done):
        seen, probes = state.pending[case], state.probes[case]
        if any(p not in seen for p in probes):
            continue
        tensors = {"hidden": torch.stack([seen[p][0] for p in probes], dim=1).contiguous(),  # [L+1, P, H]
                   "attn": torch.stack([seen[p][1] for p in probes], dim=1).contiguous(),  # [L, P, heads, hd]
                   "positions": torch.tensor(probes, dtype=torch.int64)}
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"rank{rank}.case{case}.safetensors"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file(tensors, str(tmp))
        tmp.replace(path)
        del state.pending[case]


def _capturing_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        state, scheduled = _STATE, getattr(self, "_harness_scheduled", None)
        if state is None or state.failed or scheduled is None:
            return forward(self, *args, **kwargs)
        try:
            model = self.get_model()
            if id(model) not in state.hooked:
                _hook(state, model)
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            state.forward = _plan(state, self, scheduled, positions)
        except Exception as exc:  # the probe never breaks serving
            _fail(state, exc)
        try:
            return forward(self, *args, **kwargs)
        finally:
            captured, state.forward = state.forward, None
            if captured is not None:
                try:
                    _finish(state, captured)
                except Exception as exc:
                    _fail(state, exc)

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
    """Wrap the model runner (vLLM's GPUModelRunner, which its CPU runner extends) in this process."""
    global _STATE
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner._model_forward, "__harness_probe__", False):
        return
    _STATE = _State(folder=Path(folder))
    GPUModelRunner.execute_model = _remembering(GPUModelRunner.execute_model)
    GPUModelRunner._model_forward = _capturing_forward(GPUModelRunner._model_forward)
