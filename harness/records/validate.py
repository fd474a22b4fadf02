"""Checks a run directory against the artifacts contract (harness/records/artifacts.py, harness/records/contract.py):
files, manifest fields, cases, and every tensor the run's capabilities promise, with its shape and
dtype. `harness validate RUN_DIR` prints the problems; the runner validates every run before
comparing it, so a malformed third-party run is one clear ERROR cell, not a crash."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from harness.core.errors import RunError
from harness.core.jsonio import read_json
from harness.records import contract as c
from harness.records.artifacts import RunArtifacts, read_run, run_capabilities
from harness.records.rankreport import LayoutSchemaError, read_ranks, read_speculator, schema_problem

MANIFEST_FIELDS: dict[str, type | tuple[type, ...]] = {
    "schema_version": int, "status": str, "topology": dict, "model": dict, "seed": int, "dtype": str}
TOPOLOGY_FIELDS: tuple[str, ...] = ("name", "tp", "dcp")
MODEL_FIELDS: tuple[str, ...] = ("name", "heads", "kv_heads", "head_dim", "hidden", "layers", "vocab")
INT_KINDS: frozenset[str] = frozenset({c.PREFILL_TOPK_IDS, c.DECODE_TOPK_IDS, c.GEN_TOKENS, c.GEN_TOPK_IDS,
                                       c.SPEC_TOKENS, c.SPEC_ACCEPTED, c.SPEC_DRAFTS, c.SPEC_TOPK_IDS,
                                       c.SPEC_REPREFILL_TOPK_IDS})


def load_run(path: Path) -> tuple[RunArtifacts | None, list[str]]:
    """The run directory read, or None and why it cannot be read."""
    if not path.exists():
        return None, [f"{path} does not exist"]
    if not (path / c.MANIFEST_FILE).is_file():
        return None, [f"{path}: no {c.MANIFEST_FILE}"]
    try:
        return read_run(path), []
    except RunError as exc:
        return None, [str(exc)]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return None, [f"{path}: malformed {c.CASES_FILE} or manifest ({type(exc).__name__}: {exc})"]


def validate_run(path: Path) -> list[str]:
    """Every problem of the run directory at `path` (empty: it keeps the contract)."""
    run, problems = load_run(path)
    return problems if run is None else validate_artifacts(run)


def _manifest_problems(manifest: Any) -> list[str]:
    if not isinstance(manifest, dict):
        return [f"{c.MANIFEST_FILE} is not a JSON object"]
    out = []
    for key, kind in MANIFEST_FIELDS.items():
        if key not in manifest:
            out.append(f"{c.MANIFEST_FILE} lacks {key!r}")
        elif not isinstance(manifest[key], kind) or isinstance(manifest[key], bool):
            out.append(f"{c.MANIFEST_FILE}: {key!r} is {type(manifest[key]).__name__}, "
                       f"expected {getattr(kind, '__name__', kind)}")
    if manifest.get("status") not in (None, "ok", "error"):
        out.append(f"{c.MANIFEST_FILE}: status {manifest['status']!r} is not 'ok' or 'error'")
    for key, fields in (("topology", TOPOLOGY_FIELDS), ("model", MODEL_FIELDS)):
        entry = manifest.get(key)
        if isinstance(entry, dict):
            out += [f"{c.MANIFEST_FILE}: {key} lacks {f!r}" for f in fields if f not in entry]
    return out


class _Tensors:
    """Collects tensor problems: missing, wrong dtype, wrong shape (None in a shape = any size)."""

    def __init__(self, run: RunArtifacts) -> None:
        self.run = run
        self.problems: list[str] = []

    def expect(self, kind: str, index: int, shape: tuple[int | None, ...]) -> torch.Tensor | None:
        key = c.tensor_key(kind, index)
        t = self.run.tensors.get(key)
        if t is None:
            self.problems.append(f"{c.TENSORS_FILE} lacks {key}")
            return None
        want_int = kind in INT_KINDS
        if want_int and t.dtype != torch.int64:
            self.problems.append(f"{key} has dtype {t.dtype}, expected torch.int64")
        elif not want_int and not t.is_floating_point():
            self.problems.append(f"{key} has dtype {t.dtype}, expected a floating-point dtype")
        if len(t.shape) != len(shape) or any(w is not None and w != g for w, g in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
            self.problems.append(f"{key} has shape {list(t.shape)}, expected {want}")
        return t


def layout_problems(layout: Any, reported: bool) -> list[str]:
    """layout.json's schema version, and with `reported` (the engine declares LAYOUT_REPORT) every rank
    report of its target entry and of its speculator entry (when it has one) as RankReport reads them."""
    wrong = schema_problem(layout, c.LAYOUT_SCHEMA_KEY)
    if wrong or not reported:
        return [wrong] if wrong else []
    target = layout.get("target")
    if not isinstance(target, dict) or not isinstance(target.get("ranks"), list):
        return [f"{c.LAYOUT_FILE} lacks target.ranks (the engine declares {c.LAYOUT_REPORT})"]
    out = []
    for name in ("target", "speculator"):
        if layout.get(name) is None:
            continue
        try:
            read_ranks(layout[name], f"{c.LAYOUT_FILE} {name}")
            if name == "speculator":
                read_speculator(layout[name], f"{c.LAYOUT_FILE} {name}")
        except LayoutSchemaError as exc:
            out.append(str(exc))
    return out


def validate_artifacts(run: RunArtifacts) -> list[str]:
    """Problems of a read run directory; a run whose manifest says status 'error' is one problem."""

    problems = _manifest_problems(run.manifest)
    if problems:
        return problems
    if not run.ok:
        return [f"run status is 'error': {run.manifest.get('error') or 'no error text'}"]
    try:
        caps = run_capabilities(run)
    except (TypeError, ValueError) as exc:  # unknown capability names, or no list of names
        return [f"{c.MANIFEST_FILE}: backend capabilities unreadable ({exc})"]
    model, topo = run.manifest["model"], run.manifest["topology"]
    problems += layout_problems(run.layout, caps.has(c.LAYOUT_REPORT))
    if c.GSM8K in caps.provides and (run.path / c.GSM8K_FILE).exists():
        try:
            if not isinstance(read_json(run.path / c.GSM8K_FILE), dict):
                problems.append(f"{c.GSM8K_FILE} is not a JSON object")
        except RunError as exc:
            problems.append(str(exc))
    t = _Tensors(run)
    vocab, layers = int(model["vocab"]), int(model["layers"])
    for case in run.cases:
        i, n_seq, n_dec = case.index, len(case.sequence_ids), len(case.sequence_ids) - case.decode_start
        paths = ((c.PROMPT_LOGPROBS, n_seq, c.PREFILL_LOGITS, c.PREFILL_TOPK_IDS, c.PREFILL_TOPK_LOGPROBS),
                 (c.DECODE_PATH, n_dec, c.DECODE_LOGITS, c.DECODE_TOPK_IDS, c.DECODE_TOPK_LOGPROBS))
        for cap, rows, logits, ids, lps in paths:
            if not caps.has(cap):
                continue
            if caps.has(c.FULL_LOGITS):
                t.expect(logits, i, (rows, vocab))
            if caps.has(c.TOPK_LOGPROBS):
                t.expect(ids, i, (rows, caps.top_k))
                t.expect(lps, i, (rows, caps.top_k))
        probes = len(case.probe_positions)
        if caps.has(c.HIDDEN_STATES):
            t.expect(c.HIDDEN, i, (layers + 1, probes, int(model["hidden"])))
        if caps.has(c.ATTENTION_OUTPUTS):
            t.expect(c.ATTN, i, (layers, probes, int(model["heads"]), int(model["head_dim"])))
        if caps.has(c.GENERATION):
            gen = t.expect(c.GEN_TOKENS, i, (None,))
            n = int(gen.shape[0]) if gen is not None and gen.dim() == 1 else None
            t.expect(c.GEN_TOPK_IDS, i, (n, None))
            t.expect(c.GEN_TOPK_LOGPROBS, i, (n, None))
        if topo.get("speculator", "none") != "none":
            t.expect(c.SPEC_TOKENS, i, (None,))
            if caps.has(c.ACCEPT_TRACES):
                t.expect(c.SPEC_ACCEPTED, i, (None,))
    if topo.get("speculator", "none") != "none" and not isinstance(run.manifest.get("speculative"), dict):
        problems.append(f"{c.MANIFEST_FILE} lacks 'speculative' (a -{topo['speculator']} run)")
    return problems + t.problems
