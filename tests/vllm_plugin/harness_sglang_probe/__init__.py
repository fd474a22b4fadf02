"""SGLang's adapter of the harness's hidden-state probe (harness_probe_capture): hook factories for SGLang's own
forward hooks (`--forward-hooks` JSON, sglang.srt.model_executor.hook_manager.register_forward_hooks, attached
once by ModelRunner to the loaded model), so localization runs on SGLang as on the embedded engine.

Active when $HARNESS_SGLANG_PROBE_DIR names a folder holding the harness's capture-cases.json (the template's
probe_dir_env; the harness writes it before the server starts). FORWARD_HOOKS (the template's --forward-hooks
value) attaches:
  - `batch_hook` (forward_pre, with kwargs) on `model`, the decoder stack: from the step's ForwardBatch, in an
    extend (prefill) step, which flat tokens are probe positions of a case. A request (ForwardBatch.rids) is a
    case while every chunk it extends equals the case's tokens at the chunk's positions (extend_prefix_lens_cpu,
    extend_seq_lens_cpu, input_ids); its first chunk starts at 0 (a logprob request from position 0 takes nothing
    from the radix cache). A generation request's shorter prompt never reaches the case's last probe position,
    so it never completes a case;
  - `end_hook` (forward) on `model`: the rows are kept, complete cases written;
  - `embed_hook` on `model.embed_tokens`, `layer_hook` on each `model.layers.<i>` (its layer_id), `attn_hook` on
    each `model.layers.<i>.self_attn.attn` (RadixAttention: its layer_id and tp_q_head_num).
Decode steps are never captured (they run in CUDA graphs, where no module hook fires; the probe positions are
prefill tokens of the scoring request).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from harness_probe_capture import Capture

PROBE_ENV = "HARNESS_SGLANG_PROBE_DIR"
_F = "harness_sglang_probe:"
# the template's --forward-hooks value (sglang's hook spec: name, target_modules as fnmatch patterns, hook_factory,
# hook_type, with_kwargs); layer names are matched by length ("?" is one character, "*" would match sub-modules)
FORWARD_HOOKS: list[dict[str, Any]] = [
    {"name": "harness-probe-batch", "target_modules": ["model"], "hook_factory": _F + "batch_hook",
     "hook_type": "forward_pre", "with_kwargs": True},
    {"name": "harness-probe-embed", "target_modules": ["model.embed_tokens"], "hook_factory": _F + "embed_hook"},
    {"name": "harness-probe-layers", "target_modules": ["model.layers.?", "model.layers.??", "model.layers.???"],
     "hook_factory": _F + "layer_hook"},
    {"name": "harness-probe-attn", "target_modules": ["model.layers.*.self_attn.attn"],
     "hook_factory": _F + "attn_hook"},
    {"name": "harness-probe-end", "target_modules": ["model"], "hook_factory": _F + "end_hook"},
]

_CAPTURE: Capture | None = None
_MATCHING: dict[str, set[int]] = {}  # request id -> the cases whose tokens every chunk so far equals


def _rank() -> int:
    from sglang.srt.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _capture() -> Capture | None:
    global _CAPTURE
    folder = os.environ.get(PROBE_ENV)
    if _CAPTURE is None and folder:
        _CAPTURE = Capture(folder=Path(folder), rank=_rank)
    return _CAPTURE if _CAPTURE is not None and not _CAPTURE.failed and _CAPTURE.cases else None


def _forward_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return next((a for a in (*args, *kwargs.values()) if type(a).__name__ == "ForwardBatch"), None)


def _plan(capture: Capture, batch: Any) -> None:
    """The probe rows of an extend step's flattened tokens (none in any other step)."""
    rows: list[int] = []
    labels: list[tuple[Any, int, int]] = []
    mode = batch.forward_mode
    if mode.is_extend() and not mode.is_target_verify() and batch.rids and batch.extend_seq_lens_cpu is not None:
        ids = batch.input_ids.tolist()
        start = 0
        for rid, prefix, count in zip(batch.rids, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu):
            chunk = tuple(ids[start:start + count])
            known = _MATCHING.get(rid) if prefix else set(capture.cases)
            still = {case for case in known or () if capture.cases[case][0][prefix:prefix + count] == chunk}
            _MATCHING[rid] = still
            for case in sorted(still):
                for pos in capture.cases[case][1]:
                    if prefix <= pos < prefix + count:
                        rows.append(start + pos - prefix)
                        labels.append((rid, case, pos))
            start += count
    capture.begin(rows, labels)


def _guarded(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A hook that never breaks a forward pass: an error ends the capture and is written beside it."""
    def guarded(*args: Any) -> Any:
        capture = _capture()
        if capture is None:
            return None
        try:
            hook(capture, *args)
        except Exception as exc:
            capture.fail(exc)
        return None
    return guarded


def batch_hook(_config: dict[str, Any]) -> Callable[..., Any]:
    def hook(capture: Capture, module: Any, args: tuple[Any, ...], kwargs: Any) -> None:
        if not isinstance(kwargs, dict):
            raise RuntimeError("this SGLang ran the batch hook as a forward hook: its hook_manager has no "
                               "hook_type / with_kwargs (forward_pre hooks), which the probe needs")
        capture.layers = len(module.layers)
        batch = _forward_batch(args, kwargs)
        if batch is None:
            raise RuntimeError("no ForwardBatch among the decoder stack's arguments")
        _plan(capture, batch)
    return _guarded(hook)


def end_hook(_config: dict[str, Any]) -> Callable[..., Any]:
    return _guarded(lambda capture, _module, _args, _output: capture.end())


def embed_hook(_config: dict[str, Any]) -> Callable[..., Any]:
    return _guarded(lambda capture, _module, _args, output: capture.on_hidden(0, output))


def layer_hook(_config: dict[str, Any]) -> Callable[..., Any]:
    return _guarded(lambda capture, module, _args, output: capture.on_layer(int(module.layer_id), output))


def attn_hook(_config: dict[str, Any]) -> Callable[..., Any]:
    return _guarded(lambda capture, module, _args, output: capture.on_attention(
        int(module.layer_id), output, int(module.tp_q_head_num)))
