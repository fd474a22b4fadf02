"""The files of the harness's KV store as the vLLM connector writes and reads them (the layout harness serve's P/D path
uses, harness/records/pd_files.py and harness/engine/pd/store.py, so the harness's client and checks read them
unchanged):

    NS/req{i}/p{r}.safetensors   prefill rank r's KV of request i: `k.{layer}` / `v.{layer}` [n, kv_local, d] (layer:
                                 the attention layers in model order, 0..L-1), `pos` [n], `tokens` [P], `digest`
                                 [L, kv_local, n]; metadata: the rank's layout (tp_rank, tp_size, kv_heads: the global
                                 KV head ids it holds, in slot order) and the vLLM layer names
    NS/req{i}/p{r}.done          commit marker, written after the tensors
    NS/prefill.p{r}.jsonl        one line per stored request: {"sent": [i], "lost": [], pool: not recorded}
    NS/decode/d{r}.b{n}.json     decode rank r's record of one engine step's loads (+ .safetensors: the digests of
                                 the rows it held right after placement, `held.generation.{i}.d{r}` [L, kv_local, n]
                                 and `.pos`)

A row digest is an exact hash of the bits of one token's K and V rows of one KV head in one layer (blake2b, 56 bits):
what a decode rank holds compares with what the prefill rank that computed it sent, across layouts. The harness
compares the two digests (pd_transfer); it does not recompute them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROUTE = "generation"  # the route a server loads on (HTTP has no teacher-forced decode path)


def entry_file(ns: Path, index: int, rank: int) -> Path:
    return ns / f"req{index}" / f"p{rank}.safetensors"


def done_marker(ns: Path, index: int, rank: int) -> Path:
    return ns / f"req{index}" / f"p{rank}.done"


def committed_ranks(ns: Path, index: int) -> list[int]:
    """The prefill ranks whose entry of request `index` is committed (its marker written)."""
    folder = ns / f"req{index}"
    if not folder.is_dir():
        return []
    return sorted(int(p.name[1:-len(".done")]) for p in folder.glob("p*.done"))


def row_digests(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V rows [n, heads, d] -> [heads, n] int64 digests of each row's bits."""
    kb = k.detach().cpu().contiguous().view(torch.uint8).numpy()
    vb = v.detach().cpu().contiguous().view(torch.uint8).numpy()
    n, heads = k.shape[0], k.shape[1]
    out = torch.empty(heads, n, dtype=torch.int64)
    for t in range(n):
        for h in range(heads):
            digest = hashlib.blake2b(kb[t, h].tobytes() + vb[t, h].tobytes(), digest_size=7).digest()
            out[h, t] = int.from_bytes(digest, "little")
    return out


def layer_digests(ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """Per layer K and V [n, heads, d] -> [L, heads, n]."""
    return torch.stack([row_digests(k, v) for k, v in zip(ks, vs)])


def write_entry(ns: Path, index: int, rank: int, ks: list[torch.Tensor], vs: list[torch.Tensor],
                tokens: list[int], layout: dict[str, Any]) -> None:
    """Prefill rank `rank`'s KV of request `index` (every prompt row), then its commit marker."""
    path = entry_file(ns, index, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = ks[0].shape[0]
    tensors = {f"k.{i}": k.contiguous() for i, k in enumerate(ks)}
    tensors.update({f"v.{i}": v.contiguous() for i, v in enumerate(vs)})
    tensors["pos"] = torch.arange(n, dtype=torch.int64)
    tensors["tokens"] = torch.tensor(tokens, dtype=torch.int64)
    tensors["digest"] = layer_digests(ks, vs)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"layout": json.dumps(layout)})
    os.replace(tmp, path)
    done_marker(ns, index, rank).write_text("")
    with (ns / f"prefill.p{rank}.jsonl").open("a") as f:  # pools are vLLM's scheduler's: not recorded here
        f.write(json.dumps({"free_start": None, "free_end": None, "sent": [index], "lost": []}) + "\n")


class EntryError(Exception):
    """A stored entry that cannot be used: missing, uncommitted, unreadable, of other tokens or not its digests."""


def read_heads(ns: Path, index: int, rank: int, heads: list[int], n: int,
               tokens: list[int]) -> dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """From prefill rank `rank`'s entry of request `index`: for each global KV head of `heads` it holds, per layer its
    K and V rows [n, d] of positions 0..n-1, each row verified against the digest stored with it. EntryError naming
    the entry and what is wrong with it."""
    name = f"req{index}/p{rank}"
    if not done_marker(ns, index, rank).exists():
        raise EntryError(f"entry {name} is not committed")
    try:
        with safe_open(str(entry_file(ns, index, rank)), framework="pt") as f:
            layout = json.loads((f.metadata() or {})["layout"])
            stored = f.get_tensor("tokens").tolist()
            held = [h for h in heads if h in layout["kv_heads"]]
            slots = [layout["kv_heads"].index(h) for h in held]
            layers = int(layout["layers"])
            digest = f.get_tensor("digest")
            ks = [f.get_tensor(f"k.{i}")[:n, slots] for i in range(layers)]
            vs = [f.get_tensor(f"v.{i}")[:n, slots] for i in range(layers)]
    except Exception as exc:  # a missing file (OSError), a cut one (SafetensorError), a missing key or metadata
        raise EntryError(f"entry {name} cannot be read: {type(exc).__name__}: {exc}") from exc
    if stored[:n] != tokens[:n] or len(stored) < n:
        raise EntryError(f"entry {name} holds another prompt's KV ({len(stored)} tokens)")
    got = layer_digests(ks, vs)  # [L, held, n]
    want = digest[:, slots, :n]
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[0].tolist()
        raise EntryError(f"entry {name}: layer {bad[0]} KV head {held[bad[1]]} position {bad[2]} differs from the "
                         f"digest stored with it (the file is damaged)")
    return {h: ([k[:, j] for k in ks], [v[:, j] for v in vs]) for j, h in enumerate(held)}


def write_decode_record(ns: Path, rank: int, step: int, record: dict[str, Any],
                        tensors: dict[str, torch.Tensor]) -> None:
    path = ns / "decode" / f"d{rank}.b{step:06d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path.with_suffix(".safetensors")))
    path.write_text(json.dumps(record))
