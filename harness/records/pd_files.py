"""File names of disaggregated prefill/decode's KV store that both sides and the client read (no engine code):
a prefill rank's committed entry of a request (as harness/engine/pd_store.py writes it) and the per-rank
records a `harness serve` P/D pair leaves in its run's namespace folder (harness/serve/pd.py)."""

from __future__ import annotations

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
