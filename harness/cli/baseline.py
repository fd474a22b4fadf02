"""`harness baseline`: record GSM8K, speculative-acceptance and reference baselines from a run (diff first), accept an
intended change of a reference's numerics (with a reason), or show them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from harness.baselines.acceptance_baseline import (
    AcceptanceBaselines,
    acceptance_path,
    load_acceptance,
    write_acceptance,
)
from harness.baselines.acceptance_baseline import entries_from_cells as acceptance_entries
from harness.baselines.baseline import (
    BaselineEntry,
    Baselines,
    baselines_path,
    entry_from_cell,
    load_baselines,
    skip_reason,
    write_baselines,
)
from harness.baselines.baseline_store import BaselineSet
from harness.core.errors import ConfigError
from harness.core.fmt import table
from harness.core.jsonio import read_json
from harness.core.paths import BASELINES_DIR
from harness.core.verdict import CellResult
from harness.records.results import RESULTS_FILE, read_results

if TYPE_CHECKING:
    from harness.baselines.reference_baseline import Candidate, ReferenceBaselines

def add_parser(sub: Any) -> None:
    p = sub.add_parser("baseline", help="record or show GSM8K baselines (baselines/<suite>.yaml), acceptance "
                                        "baselines (baselines/acceptance.yaml) and recorded references "
                                        "(baselines/references.yaml)")
    actions = p.add_subparsers(dest="baseline_action", required=True)
    up = actions.add_parser("update", help="write baselines from a run's results.json, showing the diff first")
    up.add_argument("--from", dest="run_dir", required=True, help="run folder holding results.json (or the file)")
    up.add_argument("--suite", default=None, help="only this suite's cells (needed when the run holds several)")
    up.add_argument("--yes", action="store_true", help="write without asking")
    up.add_argument("--dir", dest="folder", type=Path, default=BASELINES_DIR, help="baselines folder")
    up.set_defaults(func=run)
    acc = actions.add_parser("accept", help="record the references of a run that changed beyond rounding since "
                                            "their recording: an intended numerics change, with its reason")
    acc.add_argument("--from", dest="run_dir", required=True, help="run folder holding results.json (or the file)")
    acc.add_argument("--suite", default=None, help="only this suite's cells (needed when the run holds several)")
    acc.add_argument("--reason", required=True, help="why the reference's numerics changed (shown in sign-offs)")
    acc.add_argument("--yes", action="store_true", help="write without asking")
    acc.add_argument("--dir", dest="folder", type=Path, default=BASELINES_DIR, help="baselines folder")
    acc.set_defaults(func=run)
    show = actions.add_parser("show", help="print a suite's baselines, or the acceptance baselines")
    which = show.add_mutually_exclusive_group(required=True)
    which.add_argument("--suite", help="this suite's GSM8K baselines")
    which.add_argument("--acceptance", action="store_true", help="the speculative acceptance baselines")
    which.add_argument("--references", action="store_true", help="the recorded references")
    show.add_argument("--dir", dest="folder", type=Path, default=BASELINES_DIR, help="baselines folder")
    show.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from harness.baselines.reference_baseline import load_references  # torch: loaded only by this command
    if args.baseline_action == "show":
        if args.references:
            return _show_references(load_references(args.folder))
        if args.acceptance:
            return _show_acceptance(load_acceptance(args.folder))
        return _show(load_baselines(args.suite, args.folder))
    if args.baseline_action == "accept":
        return _accept(Path(args.run_dir), args.suite, args.reason, args.yes, args.folder)
    return _update(Path(args.run_dir), args.suite, args.yes, args.folder)


def _show(baselines: Baselines) -> int:
    if not baselines.entries:
        print(f"no baselines for suite {baselines.suite!r}")
        return 0
    rows = [[e.model, e.task, e.topology, str(e.n), f"{e.score:.4f}", f"{e.stderr:.4f}", e.filter,
             str(e.provenance.get("git_commit", ""))[:12], str(e.provenance.get("date", ""))]
            for e in baselines.entries]
    print(table(["model", "task", "topology", "n", "score", "stderr", "filter", "commit", "date"], rows))
    return 0


def _show_acceptance(baselines: AcceptanceBaselines) -> int:
    if not baselines.entries:
        print("no acceptance baselines")
        return 0
    rows = [[e.key.model, e.key.engine, e.key.speculator, str(e.key.k), e.key.dtype, e.key.prompts_hash[:12],
             str(e.key.max_new_tokens), f"{e.mean_accepted_length:.4f}",
             str(list(e.histogram)) if e.histogram is not None else "-", str(e.provenance.get("date", ""))]
            for e in baselines.entries]
    print(table(["model", "engine", "speculator", "k", "dtype", "prompts", "new tokens", "mean accepted length",
                 "histogram", "date"], rows))
    return 0


def _show_references(baselines: ReferenceBaselines) -> int:
    if not baselines.entries:
        print("no recorded references")
        return 0
    rows = [[e.key.model, f"{e.key.engine} {e.key.engine_version}", e.key.topology, e.key.dtype,
             e.key.weights_hash[:12], e.key.prompts_hash[:12], str(e.cases), str(e.bytes),
             str(e.provenance.get("git_commit", ""))[:12], str(e.provenance.get("date", "")),
             str(e.accepted.get("reason")) if e.accepted else "-"] for e in baselines.entries]
    print(table(["model", "engine", "topology", "dtype", "weights", "prompts", "cases", "bytes", "commit", "date",
                 "accepted change"], rows))
    return 0


def _suite_of(cells: list[CellResult], suite: str | None) -> str:
    suites = sorted({c.suite for c in cells})
    if suite is not None:
        if suite not in suites:
            raise ConfigError(f"--suite {suite!r}: the run holds suites {', '.join(suites) or 'none'}")
        return suite
    if len(suites) != 1:
        raise ConfigError(f"the run holds suites {', '.join(suites) or 'none'}; pick one with --suite")
    return suites[0]


def _entries(cells: list[CellResult], provenance: dict[str, Any], run_id: str,
             created: str) -> list[BaselineEntry]:
    entries: list[BaselineEntry] = []
    for cell in cells:
        reason = skip_reason(cell)
        if reason is not None:
            print(f"skip {cell.model} / {cell.topology} (seed {cell.seed}): {reason}")
            continue
        entry = entry_from_cell(cell, provenance, run_id, created)
        if any(e.key == entry.key for e in entries):
            raise ConfigError(f"two cells of the run give {entry.label} (seeds or repeats); "
                              f"record baselines from a run with one cell per model, task, topology and n")
        entries.append(entry)
    return entries


def _confirm(changed: int, path: Path, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        print(f"not a terminal: pass --yes to write these {changed} change(s)", file=sys.stderr)
        return False
    if input(f"write {changed} change(s) to {path}? [y/N] ").strip().lower() not in ("y", "yes"):
        print("nothing written")
        return False
    return True


def _update(run_dir: Path, suite_arg: str | None, yes: bool, folder: Path) -> int:
    """GSM8K scores into baselines/<suite>.yaml and speculative acceptance into baselines/acceptance.yaml."""
    from harness.baselines.reference_baseline import candidates, updates  # torch: loaded only by this command
    all_cells, provenance, run_id = read_results(run_dir)
    suite = _suite_of(all_cells, suite_arg)
    results_path = run_dir if run_dir.is_file() else run_dir / RESULTS_FILE
    created = str(read_json(results_path).get("created", ""))
    cells = [c for c in all_cells if c.suite == suite]
    gsm_cells = [c for c in cells if "speculator" not in c.details or "gsm8k" in c.details]
    entries = _entries(gsm_cells, provenance, run_id, created) if gsm_cells else []
    acc_entries, acc_skipped = acceptance_entries(cells, provenance, run_id, created)
    for line in acc_skipped:
        print(line)
    found, ref_skipped = candidates(cells, provenance, run_id, created, folder)
    refs, notes = updates(found, folder, None)
    for line in ref_skipped + notes:
        print(line)
    if not entries and not acc_entries and not refs and not notes:
        print(f"{run_dir}: no cell of suite {suite!r} holds a GSM8K score, a speculative acceptance or a reference "
              f"to record")
        return 1
    status = 0
    if entries:
        status = _write(baselines_path(suite, folder), f"suite {suite}", load_baselines(suite, folder), entries, yes,
                        write_baselines)
    if acc_entries and status == 0:
        status = _write(acceptance_path(folder), "speculative acceptance", load_acceptance(folder), acc_entries, yes,
                        write_acceptance)
    if refs and status == 0:
        status = _write_references(folder, "recorded references", refs, yes)
    refused = [line for line in notes if line.startswith("refused")]
    if refused:
        print(f"{len(refused)} reference(s) changed since their recording and were not written")
    return status or (1 if refused else 0)


def _accept(run_dir: Path, suite_arg: str | None, reason: str, yes: bool, folder: Path) -> int:
    """The references of a run that differ beyond rounding from their recordings, recorded with `reason`."""
    from harness.baselines.reference_baseline import candidates, updates  # torch: loaded only by this command
    if not reason.strip():
        raise ConfigError("--reason '': say why the reference's numerics changed (it is shown in sign-offs)")
    all_cells, provenance, run_id = read_results(run_dir)
    suite = _suite_of(all_cells, suite_arg)
    results_path = run_dir if run_dir.is_file() else run_dir / RESULTS_FILE
    created = str(read_json(results_path).get("created", ""))
    found, skipped = candidates([c for c in all_cells if c.suite == suite], provenance, run_id, created, folder)
    for line in skipped:
        print(line)
    refs, _ = updates(found, folder, reason.strip())
    if not refs:
        print(f"{run_dir}: no reference of suite {suite!r} differs from its recording beyond rounding; nothing to "
              f"accept")
        return 1
    for cand in refs:
        assert cand.changed is not None and cand.changed.difference is not None
        print(f"accepting {cand.entry.label}: {cand.changed.difference.text()}")
    return _write_references(folder, f"recorded references, accepted: {reason.strip()}", refs, yes)


def _write_references(folder: Path, what: str, refs: list[Candidate], yes: bool) -> int:
    """The store's diff of the recorded references, then their record files and index."""
    from harness.baselines.reference_baseline import (  # torch: loaded only by this command
        load_references,
        references_path,
        write_candidates,
    )
    path = references_path(folder)
    return _write(path, what, load_references(folder), [c.entry for c in refs], yes,
                  lambda old, p: write_candidates(refs, old, p))


S = TypeVar("S", bound=BaselineSet[Any])


def _write(path: Path, what: str, old: S, updates: list[Any], yes: bool, write: Callable[[S, Path], None]) -> int:
    """Show the diff of `updates` against the stored `old` (the store's provenance rule), ask (unless --yes),
    write."""
    lines, changed = old.diff(updates)
    print(f"{path} ({what}):")
    print("\n".join(lines))
    if changed == 0:
        print("baselines are up to date; nothing to write")
        return 0
    if not _confirm(changed, path, yes):
        return 1
    write(old.merged(updates), path)
    print(f"wrote {changed} change(s) to {path}")
    return 0
