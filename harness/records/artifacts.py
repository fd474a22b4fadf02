"""The run directory: what one launch (one model x topology x fault) leaves on disk.

Layout of a run directory (schema ARTIFACT_SCHEMA_VERSION):
  manifest.json      topology, model spec, fault, seed, dtype, weights hash, prompts hash (of the
                     teacher-forced token sequences), tokenizer hash, backend {name, version,
                     capabilities} (who wrote the run), versions,
                     device, harness git commit, wall times, status ("ok" | "error"), error text,
                     rank log tails
  layout.json        the layout each rank actually holds, target and speculator: per rank a RankReport
                     (harness/records/rankreport.py), its schema version under contract.LAYOUT_SCHEMA_KEY
  cases.json         per prompt: text, prompt ids, teacher-forced sequence, decode start,
                     probe positions, greedy generation (ids and text)
  tensors.safetensors  per prompt i (float32 unless noted):
      prefill_logits.{i}   [T, V]    teacher-forced sequence in one prefill forward
      decode_logits.{i}    [T-D, V]  positions D..T-1, each from a one-token decode step
                                     through the paged KV cache (D = decode start)
      hidden.{i}           [L+1, P, H]  decode path, residual stream after embedding and each layer,
                                        at the P probe positions
      attn.{i}             [L, P, heads, head_dim]  decode path, per-head attention output
                                                    (before o_proj) in global head order
      collectives.{i}      [tp, L, P, sites]  decode path, each rank's error of each collective's output against
                           an exact recompute from its inputs, in unit roundoffs (contract.COLLECTIVES)
      gen_tokens.{i}       [N] int64     greedy generation
      gen_topk_ids.{i}     [N, k] int64  top-k token ids at each generation step
      gen_topk_logprobs.{i} [N, k]       their log-probabilities
      spec_tokens.{i}      [N] int64     -draft/-mtp runs: greedy generation with the speculator
      spec_accepted.{i}    [S] int64     accepted draft tokens (0..k) at each verify step
      prefill_topk_ids.{i}, prefill_topk_logprobs.{i}  [T, k]    top-k-only engines (embedded-topk, HTTP)
      decode_topk_ids.{i}, decode_topk_logprobs.{i}    [T-D, k]  instead of *_logits, hidden, attn
  gsm8k.json         suites with GSM8K: lm-eval scores and per-question records (harness.gsm8k.records)
  rank{r}.log        stdout/stderr of each rank (written by the launcher)
Every stage after the launch reads only these files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from harness.core.errors import RunError
from harness.core.jsonio import read_json, write_json
from harness.records.contract import (
    CASES_FILE,
    FULL_ARTIFACTS,
    LAYOUT_FILE,
    LAYOUT_SCHEMA,
    LAYOUT_SCHEMA_KEY,
    MANIFEST_FILE,
    TENSORS_FILE,
    Capabilities,
    recorded_capabilities,
    tensor_key,
)

__all__ = ["ARTIFACT_SCHEMA_VERSION", "TENSORS_FILE", "Case", "RunArtifacts", "read_run", "write_run"]
ARTIFACT_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Case:
    """One prompt's inputs and its greedy generation."""

    index: int
    prompt: str
    prompt_ids: tuple[int, ...]
    sequence_ids: tuple[int, ...]
    decode_start: int
    probe_positions: tuple[int, ...]
    generated_ids: tuple[int, ...] = ()
    generated_text: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "prompt": self.prompt, "prompt_ids": list(self.prompt_ids),
                "sequence_ids": list(self.sequence_ids), "decode_start": self.decode_start,
                "probe_positions": list(self.probe_positions), "generated_ids": list(self.generated_ids),
                "generated_text": self.generated_text}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Case":
        return cls(index=d["index"], prompt=d["prompt"], prompt_ids=tuple(d["prompt_ids"]),
                   sequence_ids=tuple(d["sequence_ids"]), decode_start=d["decode_start"],
                   probe_positions=tuple(d["probe_positions"]), generated_ids=tuple(d["generated_ids"]),
                   generated_text=d.get("generated_text", ""))


@dataclass
class RunArtifacts:
    """An in-memory view of a run directory."""

    path: Path
    manifest: dict[str, Any]
    layout: dict[str, Any] = field(default_factory=dict)
    cases: list[Case] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.manifest.get("status") == "ok"

    def tensor(self, kind: str, case: int) -> torch.Tensor:
        key = tensor_key(kind, case)
        if key not in self.tensors:
            raise RunError(f"{self.path}: tensor {key!r} missing from {TENSORS_FILE}")
        return self.tensors[key]


def write_run(path: Path, manifest: dict[str, Any], layout: dict[str, Any], cases: list[Case],
              tensors: dict[str, torch.Tensor]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path / TENSORS_FILE))
    write_json(path / LAYOUT_FILE, {LAYOUT_SCHEMA_KEY: LAYOUT_SCHEMA, **layout})
    write_json(path / CASES_FILE, [c.to_dict() for c in cases])
    write_json(path / MANIFEST_FILE, {"schema_version": ARTIFACT_SCHEMA_VERSION, **manifest})


def read_run(path: Path, with_tensors: bool = True) -> RunArtifacts:
    manifest = read_json(path / MANIFEST_FILE)
    if manifest.get("status") != "ok":
        return RunArtifacts(path=path, manifest=manifest)
    try:
        tensors = load_file(str(path / TENSORS_FILE)) if with_tensors else {}
    except (OSError, SafetensorError) as exc:
        raise RunError(f"{path / TENSORS_FILE}: unreadable tensors: {exc}") from exc
    try:  # a case missing a field or of the wrong type is a damaged run, named, never a bare KeyError
        cases = [Case.from_dict(c) for c in read_json(path / CASES_FILE)]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RunError(f"{path / CASES_FILE}: malformed case ({type(exc).__name__}: {exc}); expected the fields "
                       f"Case.to_dict writes") from exc
    return RunArtifacts(path=path, manifest=manifest, layout=read_json(path / LAYOUT_FILE), cases=cases,
                        tensors=tensors)


def run_capabilities(run: RunArtifacts, default: Capabilities | None = None) -> Capabilities:
    """The capabilities the run's manifest records, else `default` (else every artifact of the contract)."""
    recorded = recorded_capabilities(run.manifest)
    if recorded is not None:
        return recorded
    return default if default is not None else Capabilities(provides=FULL_ARTIFACTS)
