"""Reading GGUF files (llama.cpp's format) with the `gguf` package: metadata, dequantized tensors, Q/K un-permute."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from harness.core.errors import ConfigError

GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2")
_MISSING = object()


def open_gguf(path: Path) -> Any:
    """A gguf.GGUFReader over `path` (memory-mapped), or one ConfigError naming the path and the problem.

    Readers are cached per (path, mtime, size): parsing the metadata of a 49k-token vocabulary takes seconds,
    and a spec, its weights and its tokenizer each open the same file.
    """
    require_file(path)
    stat = path.stat()
    try:
        return _reader(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ConfigError(f"GGUF file {path} is not a readable GGUF file: {exc}") from exc


def require_file(path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"GGUF file {path} does not exist")


@functools.lru_cache(maxsize=4)
def _reader(path: str, mtime_ns: int, size: int) -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise ConfigError(f"reading {path} needs the `gguf` package (the [real] extra): "
                          f"pip install -e '.[real]'") from exc
    return gguf.GGUFReader(path)


def field(reader: Any, key: str, default: Any = _MISSING) -> Any:
    """The decoded value of metadata `key` (str, number, bool or list); `default` when absent."""
    found = reader.fields.get(key)
    if found is None:
        if default is _MISSING:
            raise ConfigError(f"GGUF file {reader.data.filename}: missing metadata key {key!r}")
        return default
    return found.contents()


def architecture(reader: Any) -> str:
    """general.architecture, checked to be one the engine runs."""
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"GGUF file {reader.data.filename}: architecture {arch!r} is not supported; "
                          f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    return str(arch)


def tensor_index(reader: Any) -> dict[str, Any]:
    """Tensor name -> gguf ReaderTensor."""
    return {t.name: t for t in reader.tensors}


def dequantize(tensor: Any) -> np.ndarray:
    """One GGUF tensor as float32 in torch layout ([out, in] for matrices; GGUF lists dims innermost first)."""
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.array(values, dtype=np.float32, copy=True).reshape(shape)  # a private copy, not the memmap


def unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter permute of Q/K rows for the llama architecture.

    Hugging Face rows of one head are [first half | second half] of the head dim (rotate_half RoPE);
    the converter interleaves them (row 2j = half 0 row j, row 2j+1 = half 1 row j) for llama.cpp's
    adjacent-pair RoPE. Works for weights [n_heads*hd, H] and biases [n_heads*hd].
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ConfigError(f"cannot un-permute {rows} Q/K rows into {n_heads} heads of even size")
    half = rows // n_heads // 2
    interleaved = weight.reshape(n_heads, half, 2, *weight.shape[1:])  # [heads, hd/2, 2, ...]
    halves = interleaved.swapaxes(1, 2)  # [heads, 2, hd/2, ...]
    return np.ascontiguousarray(halves).reshape(weight.shape)  # [heads*hd, ...]


def float32_decimal(value: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))
