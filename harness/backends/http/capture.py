"""Hidden states and attention outputs an HTTP engine's server captured about itself, for localization: its
probe (tests/vllm_plugin/harness_vllm_probe/capture.py for vLLM) is told the cases' teacher-forced token ids
and probe positions through a file in its folder (`write_probe_cases`, before the server starts: the cases of
every run seed the server will serve, each set under ids of its own, `capture_offsets`) and writes, per rank and
case, the residual stream after the embedding and each layer and the per-head attention output
of the rank's own Q heads at those positions. `read_captures` turns them into the contract's tensors
(contract.HIDDEN [L+1, P, H] and contract.ATTN [L, P, heads, head_dim] in global head order: the ranks' heads
in rank order, as the embedded engine gathers them). The harness never imports the engine: it reads files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from harness.core.errors import RunError
from harness.records import contract as c
from harness.records.artifacts import Case

CASES_FILE = "capture-cases.json"  # what the probe captures (its capture.CASES_FILE)
CAPTURE_DIR = "capture"            # where it writes rank<R>.case<I>.safetensors (capture.CAPTURE_DIR)


def capture_offsets(case_sets: Sequence[Sequence[Case]]) -> list[int]:
    """The capture id offset of each of several case sets one probe captures (one set per run seed, whose case
    indexes all start at 0): case i of set s is captured as offsets[s] + i, so no two sets share an id."""
    stride = 1 + max((case.index for cases in case_sets for case in cases), default=-1)
    return [s * stride for s in range(len(case_sets))]


def write_probe_cases(folder: Path, case_sets: Sequence[Sequence[Case]]) -> None:
    """Tell the server's probe which sequences are the cases and where their probe positions are: every set of
    `case_sets` (one per run seed the server serves), each under its capture ids (capture_offsets)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = [{"case": offset + case.index, "sequence_ids": list(case.sequence_ids),
             "positions": list(case.probe_positions)}
            for offset, cases in zip(capture_offsets(case_sets), case_sets) for case in cases]
    (folder / CASES_FILE).write_text(json.dumps(data) + "\n")


def _probe_error(folder: Path) -> str | None:
    for path in sorted((folder / CAPTURE_DIR).glob("rank*.error.json")):
        try:
            return f"{path.name}: {json.loads(path.read_text()).get('error')}"
        except (OSError, ValueError):
            return f"{path.name} (unreadable)"
    return None


def _load(folder: Path, rank: int, case: Case, offset: int) -> dict[str, torch.Tensor]:
    path = folder / CAPTURE_DIR / f"rank{rank}.case{offset + case.index}.safetensors"
    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        why = _probe_error(folder)
        raise RunError(f"the server's probe captured no hidden states for case {case.index} on rank {rank} ({path}"
                       f"{'; the probe failed: ' + why if why else ''})") from None
    except (OSError, SafetensorError) as exc:
        raise RunError(f"probe capture {path} cannot be read: {exc}") from exc
    positions = [int(p) for p in tensors.get("positions", torch.empty(0))]
    if positions != list(case.probe_positions) or "hidden" not in tensors or "attn" not in tensors:
        raise RunError(f"probe capture {path} holds positions {positions} (and {sorted(tensors)}), expected "
                       f"{list(case.probe_positions)} with hidden and attn")
    return tensors


def read_captures(folder: Path, tp: int, cases: Sequence[Case], offset: int = 0) -> dict[str, torch.Tensor]:
    """hidden.{i} and attn.{i} of every case from the probe's files of a tp-rank server (case i captured as id
    `offset` + i: capture_offsets); a RunError naming the case and rank that has none."""
    out: dict[str, torch.Tensor] = {}
    for case in cases:
        ranks = [_load(folder, rank, case, offset) for rank in range(tp)]
        out[c.tensor_key(c.HIDDEN, case.index)] = ranks[0]["hidden"].float()  # the stream is replicated: rank 0's
        # each rank's own Q heads [L, P, local heads, hd], in rank order -> [L, P, heads, hd]
        out[c.tensor_key(c.ATTN, case.index)] = torch.cat([r["attn"].float() for r in ranks], dim=2)
    return out
