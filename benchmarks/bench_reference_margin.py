"""How far inside the recorded-reference bound another build's rounding lands: each reference run of a cache
folder against its reduction-order noise run (the same model, topology and dtype with another reduction order,
what a build with another kernel would compute), compared as `reference_baseline` compares a reference with its
recording (harness/baselines/reference_record.py). Prints, per reference, the largest logprob difference, the
bound at that value, the near ties crossed and whether it would PASS; asserts nothing.

    harness run --suite plain.yaml --out RUN --cache-dir CACHE     # any suite fills CACHE with both runs
    python benchmarks/bench_reference_margin.py CACHE
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.baselines.reference_baseline import bound_of_run
from harness.baselines.reference_record import compare_records, record_of
from harness.records.artifacts import RunArtifacts, read_run

NOISE = "-noise-reduction-order-"


def pairs(cache: Path) -> list[tuple[RunArtifacts, RunArtifacts]]:
    """(reference, its noise run) of every plain reference in the cache (same model, dtype and seed)."""
    runs = [read_run(p) for p in sorted((cache / "runs").iterdir()) if (p / "manifest.json").is_file()]
    runs = [r for r in runs if r.ok]
    out = []
    for ref in runs:
        if NOISE in ref.path.name or ref.manifest.get("fault") or "-draft" in ref.path.name or "-mtp" in ref.path.name:
            continue
        stem = ref.path.name.rsplit("-", 1)[0]
        noise = next((r for r in runs if r.path.name.startswith(stem + NOISE)
                      and all(r.manifest.get(f) == ref.manifest.get(f) for f in ("seed", "prompts_hash"))), None)
        if noise is not None:
            out.append((ref, noise))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cache", type=Path, help="a reference cache folder (--cache-dir of harness run)")
    args = parser.parse_args()
    print(f"{'reference':56} {'dtype':9} {'max |diff|':>10} {'bound':>9} {'ratio':>7} ties  verdict")
    for ref, noise in pairs(args.cache):
        bound = bound_of_run(ref)
        found = compare_records(record_of(ref), record_of(noise), bound, [c.index for c in ref.cases])
        ratio = found.max_error / found.bound_at_max if found.bound_at_max else 0.0
        verdict = "PASS" if found.difference is None else f"FAIL ({found.difference.text()})"
        print(f"{ref.path.name:56} {bound.dtype:9} {found.max_error:10.2e} {found.bound_at_max:9.2e} {ratio:7.3f} "
              f"{found.near_ties:4d}  {verdict}")


if __name__ == "__main__":
    main()
