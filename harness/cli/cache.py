"""`harness cache list|size|prune|servers`: the reference-run cache (default $HARNESS_CACHE_DIR, else the
user's own $XDG_CACHE_HOME/llm-parallel-harness or ~/.cache/llm-parallel-harness, mode 0700), so it does not
grow forever on a nightly box.

Each entry is one reference run under CACHE/runs/, one converted GGUF file under CACHE/gguf/ (its
tokenizer and float32 weights) or one model exported for an HTTP engine under CACHE/exports/. Its age is
the time since it was last written or reused (a run that takes an entry from the cache marks it used).
Entries still being written (`*.<pid>.partial`) belong to the live process <pid> and are never pruned while it runs.
CACHE/locks/ holds one empty lock file per reference key (harness/flow/refcache.py); they are not entries.
CACHE/servers/ holds the engine servers `harness run --keep-servers` left up (servers.json, and each one's folder
with its log): `harness cache servers` lists them, `--stop` stops them all; prune leaves them alone.
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cli.checks import positive_float
from harness.core.errors import ConfigError
from harness.core.fmt import human_bytes, table

DAY_S = 86400.0
KINDS: tuple[str, ...] = ("runs", "gguf", "exports")  # the cache's sub-folders, one entry per folder inside


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cache", help="list, size or prune the reference-run cache", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="cache folder (default: $HARNESS_CACHE_DIR, else $XDG_CACHE_HOME or ~/.cache "
                        "/llm-parallel-harness)")
    actions = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    actions.add_parser("list", help="every entry with its size and age")
    actions.add_parser("size", help="the entries' count and total size")
    prune = actions.add_parser("prune", help="delete entries not used for DAYS days")
    prune.add_argument("--older-than", type=positive_float, required=True, metavar="DAYS",
                       help="delete entries last used more than DAYS days ago (fractions allowed)")
    prune.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    servers = actions.add_parser("servers", help="the engine servers harness run --keep-servers left up, and any "
                                 "process a killed harness run left behind")
    servers.add_argument("--stop", action="store_true", help="stop every one of them")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class Entry:
    path: Path
    bytes: int
    last_used: float  # seconds since the epoch
    partial: bool

    def age_days(self, now: float) -> float:
        return max(0.0, now - self.last_used) / DAY_S

    def in_use(self) -> bool:
        """A partial entry whose writer is still alive."""
        from harness.flow.refcache import partial_alive
        return self.partial and partial_alive(self.path)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def entries(cache_dir: Path) -> list[Entry]:
    from harness.flow.refcache import PARTIAL_SUFFIX

    found = []
    for kind in KINDS:
        folder = cache_dir / kind
        if not folder.is_dir():
            continue
        for path in sorted(p for p in folder.iterdir() if p.is_dir()):
            found.append(Entry(path=path, bytes=_size(path), last_used=path.stat().st_mtime,
                               partial=path.name.endswith(PARTIAL_SUFFIX)))
    return found


def _age(days: float) -> str:
    return f"{days * 24:.1f} h" if days < 1 else f"{days:.1f} d"


def run(args: argparse.Namespace) -> int:
    from harness.core.paths import default_cache_dir

    cache_dir: Path = args.cache_dir or default_cache_dir()
    if cache_dir.exists() and not cache_dir.is_dir():
        raise ConfigError(f"--cache-dir {cache_dir} is a file, not a cache folder; give the folder the runs used "
                          f"(--cache-dir of harness run, default $HARNESS_CACHE_DIR or ~/.cache/llm-parallel-harness)")
    if args.action == "servers":
        return kept_servers(cache_dir, args.stop)
    found, now = entries(cache_dir), time.time()
    total = sum(e.bytes for e in found)
    if args.action == "list":
        rows = [[f"{e.path.parent.name}/{e.path.name}", human_bytes(e.bytes), _age(e.age_days(now)),
                 ("being written" if e.in_use() else "partial (abandoned)") if e.partial else "ok"] for e in found]
        print(table(["entry", "size", "last used", "state"], rows) if rows else f"cache {cache_dir} is empty")
        print(f"{len(found)} entr{'y' if len(found) == 1 else 'ies'}, {human_bytes(total)} in {cache_dir}")
    elif args.action == "size":
        print(f"{len(found)} entr{'y' if len(found) == 1 else 'ies'}, {human_bytes(total)} ({total} bytes) "
              f"in {cache_dir}")
    else:
        old = [e for e in found if e.age_days(now) > args.older_than and not e.in_use()]
        for e in old:
            if not args.dry_run:
                shutil.rmtree(e.path, ignore_errors=True)
            print(f"{'would delete' if args.dry_run else 'deleted'} {e.path.name} ({human_bytes(e.bytes)}, "
                  f"last used {_age(e.age_days(now))} ago)")
        freed = sum(e.bytes for e in old)
        print(f"{'would free' if args.dry_run else 'freed'} {human_bytes(freed)} in {len(old)} "
              f"entr{'y' if len(old) == 1 else 'ies'}; {len(found) - len(old)} kept")
    return 0


def kept_servers(cache_dir: Path, stop: bool) -> int:
    """List the kept engine servers (id, pid, URL, whether it still runs), or stop them all."""
    from harness.backends.http.pool import STATE_FILE, kept, pid_alive, stop_kept
    from harness.launcher.orphans import kill, orphans

    state = cache_dir / "servers" / STATE_FILE
    left = orphans()  # processes of a harness run that was killed (SIGKILL) and whose guardian is gone too
    if stop:
        stopped = stop_kept(state)
        print(f"stopped {len(stopped)} kept engine server(s){': ' + ', '.join(stopped) if stopped else ''}")
        if left:
            gone = kill(left)
            print(f"stopped {len(gone)} process(es) left by killed harness runs: "
                  f"{', '.join(str(m.pid) for m in gone)}")
        return 0
    rows = [[str(e["id"]), str(e["pid"]), str(e["url"]), "up" if pid_alive(int(e["pid"])) else "gone"]
            for e in kept(state)]
    print(table(["server", "pid", "url", "state"], rows) if rows else f"no kept engine servers in {cache_dir}")
    if left:
        print(f"{len(left)} process(es) left by harness runs that were killed (harness cache servers --stop "
              f"stops them):")
        print(table(["pid", "its run (gone)", "command"],
                    [[str(m.pid), str(m.owner_pid), m.command[:100]] for m in left]))
    return 0
