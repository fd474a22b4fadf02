"""Disaggregated prefill/decode over HTTP (a PREFILL>DECODE topology on an engine template with `pd_argv`): what
the client sends to the two servers and how their store becomes the run's pd.json / pd.safetensors.

The run (HttpBackend._run_pd) leases a prefill server (the prefill layout) and a decode server (the decode layout)
sharing the store folder {pd_store}; each case's teacher-forced scores and its first new token (the prefill-only
result) come from the prefill server, then its generation from the decode server, which loads the prompt's KV.
On a `harness` store (harness serve) every generation request names its entry (kv_transfer_params: the run's
namespace folder and the case index), and the servers' ranks leave their records there (harness/serve/pd.py):
they become the run's PD_RECORD / PD_TENSORS as the embedded engine writes them, so pd_transfer, pd_load and
pd_consistency run unchanged. On a `shared-storage` store (vLLM's ExampleConnector) the engine keys the KV by
prompt hash and keeps no record: the run's PD_RECORD holds the prefill requests and the stored files' digests
(no decode ranks), so pd_consistency runs and pd_transfer / pd_load are a SKIP saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import load_file, save_file

from harness.backends.http.dialects import Generation, Post
from harness.records.artifacts import Case
from harness.records.contract import PD_RECORD_FILE, PD_STORE_DIR, PD_TENSORS_FILE
from harness.records.pd_files import PREFILL_RECORD, decode_records, entry_done, entry_file, prefill_log
from harness.specs.topology import Topology

PREFILL_SERVER_LOG = "server-prefill.log"


def store_root(key: str) -> Path:
    """The store folder of one server pair's configuration (both servers are started with it)."""
    return Path(tempfile.gettempdir()) / f"harness-pd-{os.getuid()}" / key[:16]


def new_namespace() -> str:
    """A run's own folder name in a `harness` store."""
    return uuid.uuid4().hex[:16]


def kv_post(post: Post, namespace: str, index_of: dict[tuple[int, ...], int]) -> Post:
    """`post` with kv_transfer_params added to every completion whose prompts are all cases' prompts (a score request
    of prompt + continuation is sent as it is)."""
    def send(path: str, body: dict[str, Any]) -> Any:
        prompts = body.get("prompt")
        if isinstance(prompts, list) and prompts and all(tuple(p) in index_of for p in prompts):
            body = {**body, "kv_transfer_params": {"namespace": namespace,
                                                   "requests": [index_of[tuple(p)] for p in prompts]}}
        return post(path, body)
    return send


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _prefill_only(cases: Sequence[Case], first: Sequence[Generation]) -> dict[str, torch.Tensor]:
    """Each case's first new token's top-k as the prefill server answered it."""
    out: dict[str, torch.Tensor] = {}
    for case, g in zip(cases, first):
        out[f"prefill_only.topk_ids.{case.index}"] = g.ids[0].contiguous()
        out[f"prefill_only.topk_logprobs.{case.index}"] = g.logprobs[0].contiguous()
    return out


def sent_digests(root: Path, namespace: str, prefill: Topology, cases: Sequence[Case]) -> dict[str, torch.Tensor]:
    """The digests (and positions) each prefill rank committed per request, read once the prefill phase ended
    (before any store damage): what the prefill side sent."""
    ns = root / namespace
    out: dict[str, torch.Tensor] = {}
    for case in cases:
        for r in range(prefill.tp):
            if entry_done(ns, case.index, r).exists():
                entry = load_file(str(entry_file(ns, case.index, r)))
                out[f"sent.{case.index}.p{r}"] = entry["digest"]
                out[f"sent.{case.index}.p{r}.pos"] = entry["pos"]
    return out


def write_harness_record(root: Path, namespace: str, run_dir: Path, prefill: Topology, cases: Sequence[Case],
                         first: Sequence[Generation], sent: dict[str, torch.Tensor]) -> None:
    """PD_RECORD / PD_TENSORS of a run on a `harness` store from the servers' per-rank files; the namespace folder
    moves into the run directory (PD_STORE_DIR), as the embedded engine keeps its store."""
    ns = root / namespace
    ranks = []
    for r in range(prefill.tp):
        lines = _jsonl(prefill_log(ns, r))
        ranks.append({"free_start": lines[0]["free_start"] if lines else -1,
                      "free_end": lines[-1]["free_end"] if lines else -1,
                      "sent": [i for line in lines for i in line["sent"]],
                      "lost": [i for line in lines for i in line["lost"]]})
    requests = [{"index": c.index, "tokens": len(c.prompt_ids)} for c in cases]
    prefill_record = {"topology": prefill.to_dict(), "ranks": ranks, "requests": requests}
    tensors = _prefill_only(cases, first)
    decode: dict[int, dict[str, Any]] = {}
    policy: dict[str, Any] = {}
    block_size = 0
    for path in decode_records(ns):
        rec = json.loads(path.read_text())
        policy, block_size = rec.pop("policy"), rec.pop("block_size")
        mine = decode.setdefault(int(rec["rank"]), {**rec, "loads": []})
        mine["loads"] += rec["loads"]
        mine["pool"] = {**mine["pool"], "free_end": rec["pool"]["free_end"]}  # the first batch's start, last's end
        tensors.update(load_file(str(path.with_suffix(".safetensors"))))
    tensors.update(sent)
    (ns / PREFILL_RECORD).write_text(json.dumps(prefill_record))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(run_dir / PD_TENSORS_FILE))
    doc = {"policy": policy, "prefill": prefill_record, "decode": [decode[r] for r in sorted(decode)],
           "block_size": block_size, "store": "harness"}
    (run_dir / PD_RECORD_FILE).write_text(json.dumps(doc))
    target = run_dir / PD_STORE_DIR
    shutil.rmtree(target, ignore_errors=True)
    shutil.move(str(ns), str(target))


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_shared_storage_record(root: Path, run_dir: Path, prefill: Topology, cases: Sequence[Case],
                                first: Sequence[Generation]) -> None:
    """PD_RECORD / PD_TENSORS of a run on a `shared-storage` store: the prefill requests, the prefill-only top-k and
    every stored file with its size and sha256 (the engine keeps no load record: no `decode` entry)."""
    stored = [{"file": str(p.relative_to(root)), "bytes": p.stat().st_size, "sha256": file_digest(p)}
              for p in sorted(root.rglob("*.safetensors"))]
    doc = {"prefill": {"topology": prefill.to_dict(), "ranks": [],
                       "requests": [{"index": c.index, "tokens": len(c.prompt_ids)} for c in cases]},
           "store": "shared-storage", "stored_files": stored}
    save_file(_prefill_only(cases, first), str(run_dir / PD_TENSORS_FILE))
    (run_dir / PD_RECORD_FILE).write_text(json.dumps(doc))
    target = run_dir / PD_STORE_DIR
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(root, target)


def clear(root: Path) -> None:
    """An empty store folder (a shared-storage store is keyed by prompt: a run starts from none stored)."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)



def note_damage(run_dir: Path, condition: str, files: list[str]) -> None:
    """The store damage the run applied between its phases, in its PD_RECORD (`store_damage`)."""
    path = run_dir / PD_RECORD_FILE
    doc = json.loads(path.read_text())
    doc["store_damage"] = {"condition": condition, "files": files}
    path.write_text(json.dumps(doc))
