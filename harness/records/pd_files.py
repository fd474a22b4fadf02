"""File names of disaggregated prefill/decode's KV store that both sides and the client read (no engine code):
a prefill rank's committed entry of a request (as harness/engine/pd/store.py writes it) and the per-rank
records a `harness serve` P/D pair leaves in its run's namespace folder (harness/serve/pd.py)."""

from __future__ import annotations

import json
from pathlib import Path

PREFILL_RECORD = "prefill.json"  # the prefill world's record in a store (pd_store.PREFILL_RECORD)
DECODE_DIR = "decode"            # a namespace's decode rank records: d{rank}.b{batch}.json / .safetensors


def entry_file(store: Path, index: int, rank: int) -> Path:
    return store / f"req{index}" / f"p{rank}.safetensors"


def entry_done(store: Path, index: int, rank: int) -> Path:
    return store / f"req{index}" / f"p{rank}.done"


def prefill_log(store: Path, rank: int) -> Path:
    """Prefill rank `rank`'s record of every batch it served into `store` (one JSON line per batch)."""
    return store / f"prefill.p{rank}.jsonl"


def decode_record(store: Path, rank: int, batch: int) -> Path:
    """Decode rank `rank`'s record of one batch (its .safetensors twin holds the digests of the rows it held)."""
    return store / DECODE_DIR / f"d{rank}.b{batch:06d}.json"


def decode_records(store: Path) -> list[Path]:
    """Every decode rank's per-batch record in `store`, in name order."""
    return sorted((store / DECODE_DIR).glob("d*.b*.json"))


# store damage between the prefill and the decode phase (load conditions, harness/engine/faults.py LOAD_CONDITIONS):
# what a decode side does with a stored KV entry that is gone, cut short, or parses but holds other values
STORE_DAMAGE: tuple[str, ...] = ("pd-store-missing", "pd-store-truncated", "pd-store-corrupt")
KV_TENSOR_PREFIXES: tuple[str, ...] = ("k.", "v.", "kv_cache")  # the KV tensors of a harness entry / vLLM's file


def _kv_ranges(data: bytes) -> list[tuple[int, int]]:
    """Absolute byte ranges of a safetensors file's KV tensors (header: 8-byte little-endian length, then JSON)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    start = 8 + size
    return [(start + t["data_offsets"][0], start + t["data_offsets"][1]) for name, t in header.items()
            if name != "__metadata__" and name.startswith(KV_TENSOR_PREFIXES)]


def damage_store(store: Path, condition: str) -> list[str]:
    """Damage every stored KV file (`*.safetensors` in a folder under `store`: a request's entry) by `condition`
    (STORE_DAMAGE): delete it, cut it to half its size, or rotate each KV tensor's bytes by half its length (whole
    8-byte words: the file parses, every value is a real KV value of another row); the files damaged, relative to
    `store`."""
    if condition not in STORE_DAMAGE:
        raise ValueError(f"unknown store damage {condition!r}; valid: {', '.join(STORE_DAMAGE)}")
    done = []
    for path in sorted(p for p in store.rglob("*.safetensors") if p.parent != store):  # entries: per-request folders
        data = path.read_bytes()
        if condition == "pd-store-missing":
            path.unlink()
        elif condition == "pd-store-truncated":
            path.write_bytes(data[:len(data) // 2])
        else:
            out = bytearray(data)
            for lo, hi in _kv_ranges(data):
                shift = ((hi - lo) // 2) // 8 * 8
                out[lo:hi] = data[lo + shift:hi] + data[lo:lo + shift]
            path.write_bytes(bytes(out))
        done.append(str(path.relative_to(store)))
    return done
