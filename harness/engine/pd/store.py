"""The KV store of disaggregated prefill/decode: files the harness owns under the cell's run directory.

Layout (STORE_DIR under the decode run's folder):
    req{i}/p{r}.safetensors   prefill rank r's KV of request i: `k.{layer}` / `v.{layer}` [n, kv_local, d]
                              (v absent for an MLA latent cache), `pos` [n] (the prompt positions rank r
                              stored, in storage order), `tokens` [P] (the request's prompt ids) and
                              `digest` [layers, kv_local, n] (the per-row digests taken when the prefill
                              computed the KV, before any send)
    req{i}/p{r}.done          commit marker, written after the tensors (a reader never sees half a file)
    prefill.json              the prefill world's record: requests, its pool accounting, first-token top-k
    prefill_only.safetensors  per request the prefill world's top-k of the first new token
A row digest is an exact integer hash of the row's bits (K and V of one token, one KV head, one layer),
so the digests of what the prefill sent and of what a decode rank holds compare across layouts.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from harness.engine.runtime.kvcache import PagedKVCache
from harness.records.contract import PD_STORE_DIR

STORE_DIR = PD_STORE_DIR
PREFILL_RECORD = "prefill.json"
PREFILL_ONLY = "prefill_only.safetensors"
_MOD = (1 << 61) - 1
_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def request_dir(store: Path, index: int) -> Path:
    return store / f"req{index}"


def rank_file(store: Path, index: int, rank: int) -> Path:
    return request_dir(store, index) / f"p{rank}.safetensors"


def done_marker(store: Path, index: int, rank: int) -> Path:
    return request_dir(store, index) / f"p{rank}.done"


def row_digest(k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
    """[n, heads, d] K (and V) rows -> [heads, n] int64 digests of their bits (exact, layout-independent)."""
    def bits(x: torch.Tensor) -> torch.Tensor:
        size = min(x.element_size(), 4)  # 8-byte values are read as two 32-bit words
        # [n, heads, d] -> [n, heads, d * element_size / size] unsigned words below 2^32
        ints = x.detach().cpu().contiguous().view(_INT_OF[size]).to(torch.int64) & ((1 << (8 * size)) - 1)
        weights = (torch.arange(ints.shape[-1], dtype=torch.int64) * 2654435761 % 1048573) + 1  # [d'] below 2^20
        return (ints * weights).sum(dim=-1) % _MOD  # [n, heads]; each term below 2^52

    out = bits(k)
    if v is not None:
        out = (out * 3 + bits(v)) % _MOD
    return out.transpose(0, 1).contiguous()  # [heads, n]


def write_entry(store: Path, index: int, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    """Write prefill rank `rank`'s tensors of request `index`, then its commit marker."""
    path = rank_file(store, index, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)
    done_marker(store, index, rank).write_text("")


def read_entry(store: Path, index: int, rank: int) -> dict[str, torch.Tensor]:
    """Prefill rank `rank`'s committed tensors of request `index`; FileNotFoundError naming the entry when
    it was never committed."""
    if not done_marker(store, index, rank).exists():
        raise FileNotFoundError(f"KV store entry of request {index} from prefill rank {rank} is not committed "
                                f"({done_marker(store, index, rank)})")
    return load_file(str(rank_file(store, index, rank)))


def pool_rows(cache: PagedKVCache, blocks: list[int], n: int) -> torch.Tensor:
    """Flattened-pool rows [n] of storage slots 0..n-1 of a sequence with block table `blocks`."""
    bs = cache.block_size
    return torch.tensor([blocks[j // bs] * bs + j % bs for j in range(n)], dtype=torch.long, device=cache.k[0].device)


def layer_rows(cache: PagedKVCache, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K (and V; None for a latent cache without value pools) [n, kv_local, d] at flattened-pool `rows` of `layer`."""
    k = cache.k[layer].view(-1, *cache.k[layer].shape[2:])[rows]  # [blocks * bs, kv, d] -> [n, kv, d]
    v = cache.v[layer].view(-1, *cache.v[layer].shape[2:])[rows] if cache.v else None
    return k, v


def sequence_digests(cache: PagedKVCache, seq_id: int) -> torch.Tensor:
    """[layers, kv_local, stored] digests of every row a sequence holds now, in storage order."""
    state = cache.seqs[seq_id]
    rows = pool_rows(cache, state.blocks, state.stored)
    return torch.stack([row_digest(*layer_rows(cache, layer, rows)) for layer in range(len(cache.k))])
