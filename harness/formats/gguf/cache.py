"""What the engine derives from a GGUF file, converted once per file and machine.

Parsing a GGUF's metadata with the `gguf` package takes ~7 s for a 49k-token vocabulary (SmolLM2) and
dequantizing its tensors ~3 s more, in every process that touches the model: each rank of each launch,
the reference and its noise run, the harness itself. The converted tokenizer (tokenizers' own JSON
format) and weights (float32 safetensors) are kept under CACHE/gguf/{stem}-{key}/, keyed by the file's
resolved path, size and modification time and by CONVERTER_VERSION (bumped when a conversion changes).
Each file is written under a private name and renamed into place: processes converting at once never
read half a file, and the last rename wins with identical content.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from harness.core.paths import default_cache_dir
from harness.formats.gguf.file import require_file

CONVERTER_VERSION = 1


def cache_folder(path: Path) -> Path:
    """CACHE/gguf/{stem}-{key} of the GGUF file at `path` (one ConfigError when there is none)."""
    require_file(path)
    stat = path.stat()
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    return default_cache_dir() / "gguf" / f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def converted(path: Path, name: str, build: Callable[[Path], None]) -> Path:
    """The cached file `name` derived from the GGUF at `path`; `build(tmp)` writes it when absent."""
    target = cache_folder(path) / name
    if target.is_file():
        os.utime(target.parent)  # last used now: `harness cache prune` goes by this
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{name}.{os.getpid()}.tmp")
    try:
        build(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
