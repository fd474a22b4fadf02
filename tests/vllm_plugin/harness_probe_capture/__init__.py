"""The engine-neutral half of the harness's hidden-state probe: which sequences and positions to keep (the
harness writes them into the probe folder as `capture-cases.json` before the server starts), the rows a forward
pass holds of them, what the forward hooks copy out, and the files written per rank and case. The engine
adapters (harness_vllm_probe.capture for vLLM, harness_sglang_probe for SGLang) find the rows in their batches
and put the hooks on their models.

Per row, the hooks keep the residual stream after the embedding and after every decoder layer ([L+1, H]) and
each layer's attention output before o_proj, this rank's own Q heads ([L, heads, head dim]); tensors are copied
out (and cloned) at once, since the next layer's fused add-norm overwrites its inputs in place. A request's
(case, position) rows are pending until every probe position of the case is seen (a prompt may come in chunks);
then `capture/rank<R>.case<I>.safetensors` is written: hidden [L+1, P, H], attn [L, P, heads, head dim]
(float32) and positions [P]. A failure is written to `capture/rank<R>.error.json` and ends the capture, never
the serving.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

CASES_FILE = "capture-cases.json"
CAPTURE_DIR = "capture"

Label = tuple[Any, int, int]  # (the request's key in the engine, case, position)


@dataclass
class Forward:
    """The probe rows of the forward pass running now, and what the hooks copied out of them."""

    rows: Any  # torch.Tensor [R] int64: flat token indices of the batch
    labels: list[Label]
    hidden: dict[int, Any] = field(default_factory=dict)  # hidden index (0: embedding) -> [R, H]
    attn: dict[int, Any] = field(default_factory=dict)  # layer -> [R, local Q heads, head dim]

    def take(self, t: Any) -> Any:
        """The probe rows of `t` [N, ...], copied (and cloned: in-place kernels reuse `t`) as float32."""
        rows = self.rows if self.rows.device == t.device else self.rows.to(t.device)
        return t.detach().index_select(0, rows).clone().float().cpu()


@dataclass
class Capture:
    """One process's capture: `rank` tells its tensor-parallel rank (asked when a file is written)."""

    folder: Path
    rank: Callable[[], int]
    layers: int = 0
    forward: Forward | None = None
    failed: bool = False
    hooked: set[int] = field(default_factory=set)  # id() of the models the hooks are on
    _cases: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None = None  # case -> (sequence, probes)
    # (request key, case) -> position -> (hidden [L+1, H], attn [L, heads, head dim])
    _pending: dict[tuple[Any, int], dict[int, tuple[Any, Any]]] = field(default_factory=dict)

    @property
    def cases(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """case -> (its teacher-forced token ids, its probe positions), from the harness's file (none: {})."""
        if self._cases is None:
            path = self.folder / CASES_FILE
            data = json.loads(path.read_text()) if path.is_file() else []
            self._cases = {int(e["case"]): (tuple(int(t) for t in e["sequence_ids"]),
                                            tuple(sorted(int(p) for p in e["positions"]))) for e in data}
        return self._cases

    def begin(self, rows: list[int], labels: list[Label]) -> None:
        """The forward pass about to run holds these probe rows (none: nothing is kept)."""
        import torch

        self.forward = Forward(rows=torch.tensor(rows, dtype=torch.int64), labels=labels) if rows else None

    def on_hidden(self, index: int, stream: Any) -> None:
        """Hidden index `index` (0: the embedding output, l + 1: layer l's) of every token, [N, H]."""
        if self.forward is not None:
            self.forward.hidden[index] = self.forward.take(stream)

    def on_layer(self, layer: int, output: Any) -> None:
        """A decoder layer's output: a tensor, or (hidden, residual) with the residual add deferred (summed)."""
        if self.forward is None:
            return
        if isinstance(output, (tuple, list)):
            stream = self.forward.take(output[0])
            if len(output) > 1 and output[1] is not None:
                stream = stream + self.forward.take(output[1])
        else:
            stream = self.forward.take(output)
        self.forward.hidden[layer + 1] = stream

    def on_attention(self, layer: int, output: Any, heads: int) -> None:
        """A layer's attention output (before o_proj) of every token, [N, heads * head dim]."""
        if self.forward is not None:
            rows = self.forward.take(output)  # [R, heads * hd]
            self.forward.attn[layer] = rows.view(rows.shape[0], heads, -1)  # [R, heads * hd] -> [R, heads, hd]

    def end(self) -> None:
        """After the forward pass: keep its rows, write every case of a request whose positions are all seen."""
        forward, self.forward = self.forward, None
        if forward is None or self.failed:
            return
        try:
            self._finish(forward)
        except Exception as exc:  # the probe never breaks serving
            self.fail(exc)

    def _finish(self, forward: Forward) -> None:
        import torch
        from safetensors.torch import save_file

        expected = list(range(self.layers + 1))
        if sorted(forward.hidden) != expected or sorted(forward.attn) != expected[:-1]:
            raise RuntimeError(f"hooks captured hidden indices {sorted(forward.hidden)} and attention layers "
                               f"{sorted(forward.attn)} of {self.layers} layers (does the model run eagerly?)")
        touched = set()
        for k, (key, case, pos) in enumerate(forward.labels):
            hidden = torch.stack([forward.hidden[i][k] for i in expected])  # L+1 x [H] -> [L+1, H]
            attn = torch.stack([forward.attn[i][k] for i in expected[:-1]])  # L x [heads, hd] -> [L, heads, hd]
            self._pending.setdefault((key, case), {})[pos] = (hidden, attn)
            touched.add((key, case))
        out = self.folder / CAPTURE_DIR
        for key, case in touched:
            seen, probes = self._pending[(key, case)], self.cases[case][1]
            if any(p not in seen for p in probes):
                continue
            tensors = {"hidden": torch.stack([seen[p][0] for p in probes], dim=1).contiguous(),  # [L+1, P, H]
                       "attn": torch.stack([seen[p][1] for p in probes], dim=1).contiguous(),  # [L, P, heads, hd]
                       "positions": torch.tensor(probes, dtype=torch.int64)}
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"rank{self.rank()}.case{case}.safetensors"
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            save_file(tensors, str(tmp))
            tmp.replace(path)
            del self._pending[(key, case)]

    def fail(self, exc: BaseException) -> None:
        import traceback

        self.failed, self.forward = True, None
        out = self.folder / CAPTURE_DIR
        out.mkdir(parents=True, exist_ok=True)
        try:
            rank = self.rank()
        except Exception:
            rank = 0
        (out / f"rank{rank}.error.json").write_text(json.dumps({"error": repr(exc),
                                                                "traceback": traceback.format_exc()}))
