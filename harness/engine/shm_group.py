"""Collectives among the ranks of one machine through a shared-memory segment (Linux, x86-64).

gloo moves even a 256-byte tensor through loopback TCP and its own I/O threads: 0.6-4.6 ms per
collective at 2-8 ranks on a 2-core machine, most of a small model's decode step. Ranks on one
machine can instead exchange tensors through memory they all map: each member of a group copies its
tensor into its own slot, publishes the collective's sequence number in its own control word and wakes
the waiters (a futex on that word); each member then waits until every member has published that
number, and reads every slot (a sum in member order, or a concatenation). Every word has one writer,
so no atomic read-modify-write is needed; x86-64 keeps stores in order, so a reader that sees the
number sees the data written before it.

Slots are double-buffered: collective k uses half k % 2. A member that writes half k % 2 has seen
every member publish k - 1, which each does only after it finished reading collective k - 2, the last
user of that half. So one publish and one wait per collective, no broadcast, and every member does
the same arithmetic on the same bytes (every rank alike, as a broadcast result would be).

A tensor larger than a slot goes through in slot-sized pieces of its flattened elements; an
elementwise sum or a copy per piece is the same arithmetic as on the whole.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from harness.errors import ConfigError, RunError

SHM_ENV = "HARNESS_SHM_COLLECTIVES"  # "1" (default): on where supported; "0": gloo's collectives
SHM_SETTINGS = ("0", "1")
SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 256 * 1024  # one member's piece of one collective; a segment holds 2 x members slots
WORD_STRIDE = 64  # bytes between control words: one cache line each
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not _PRIVATE) futexes: the words live in several processes
_WAIT_SLICE_S = 1  # a wait wakes at least this often to check its deadline
_MASK = 0xFFFFFFFF  # sequence numbers are 32-bit words, compared modulo 2**32


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def supported() -> bool:
    """Whether this platform can run the shared-memory path: Linux on x86-64 with /dev/shm."""
    return (sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
            and SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK))


def enabled(setting: str | None) -> bool:
    """The HARNESS_SHM_COLLECTIVES setting ("0" or "1"; unset: "1") on a supported platform."""
    if setting not in (None, "", *SHM_SETTINGS):
        raise ConfigError(f"{SHM_ENV}={setting!r} is not valid; valid: 1 (shared-memory collectives among "
                          f"the ranks of one machine, the default) or 0 (gloo's own)")
    return setting != "0" and supported()


def segment_bytes(members: int) -> int:
    """Control words, then two halves of `members` slots each."""
    return members * WORD_STRIDE + 2 * members * SLOT_BYTES


class ShmGroup:
    """One process group's segment, as mapped by member `index` of `members` ranks."""

    def __init__(self, segment: mmap.mmap, members: int, index: int, timeout_s: float) -> None:
        self._segment = segment  # kept: the tensor below views its memory
        self._bytes = torch.frombuffer(segment, dtype=torch.uint8)  # [segment_bytes(members)]
        self.members = members
        self.index = index
        self._timeout_s = timeout_s
        base = self._bytes.data_ptr()
        self._words = [base + j * WORD_STRIDE for j in range(members)]
        self._seq = [ctypes.c_uint32.from_address(a) for a in self._words]
        self._count = 0  # collectives done on this group
        self._views: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}  # (half, numel, dtype) -> slots
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._futex_args = [(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(a)) for a in self._words]
        self._wake = (ctypes.c_int(_FUTEX_WAKE), ctypes.c_int(0x7FFFFFFF), None, None, ctypes.c_int(0))
        self._slice = ctypes.byref(_Timespec(_WAIT_SLICE_S, 0))

    @classmethod
    def create(cls, path: Path, members: int, index: int, timeout_s: float) -> "ShmGroup":
        """The group's first member: a new segment file (only this user may open it), its memory
        reserved now so a full /dev/shm fails here (OSError) rather than with SIGBUS mid-run."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, segment_bytes(members))
            return cls(mmap.mmap(fd, segment_bytes(members)), members, index, timeout_s)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, path: Path, members: int, index: int, timeout_s: float) -> "ShmGroup":
        """Another member: map the segment the first member created."""
        fd = os.open(path, os.O_RDWR)
        try:
            return cls(mmap.mmap(fd, segment_bytes(members)), members, index, timeout_s)
        finally:
            os.close(fd)

    def pieces(self, x: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """Exchange x's flattened elements slot by slot: yields (offset, every member's piece [members, n]
        in member order), a view of the segment valid until the next step of the iteration."""
        flat = x.reshape(-1)  # [numel]
        step = SLOT_BYTES // x.element_size()
        for start in range(0, max(1, flat.numel()), step):
            yield start, self._exchange(flat[start:start + step])

    def _exchange(self, piece: torch.Tensor) -> torch.Tensor:
        self._count += 1
        k = self._count & _MASK
        slots = self._slots(self._count % 2, piece.numel(), piece.dtype)  # [members, n]
        slots[self.index].copy_(piece)
        self._seq[self.index].value = k  # after the data: x86-64 keeps stores in order
        self._syscall(*self._futex_args[self.index], *self._wake)
        for j in range(self.members):
            self._wait_for(j, k)
        return slots

    def _slots(self, half: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Every member's slot in `half` as [members, numel] of `dtype` (rows SLOT_BYTES apart); made once
        per size."""
        key = (half, numel, dtype)
        if key not in self._views:
            size = dtype.itemsize
            whole = self._bytes[: self._bytes.numel() // size * size].view(dtype)  # the segment as dtype
            start = (self.members * WORD_STRIDE + half * self.members * SLOT_BYTES) // size
            self._views[key] = whole.as_strided((self.members, numel), (SLOT_BYTES // size, 1), start)
        return self._views[key]

    def _wait_for(self, member: int, k: int) -> None:
        """Until `member` has published collective k (or a later one) or the timeout passes."""
        word = self._seq[member]
        deadline = 0.0
        while True:
            seen = word.value
            if (seen - k) & _MASK < 0x80000000:
                return
            if not deadline:
                deadline = time.monotonic() + self._timeout_s
            elif time.monotonic() > deadline:
                raise RunError(f"shared-memory collective {k} timed out after {self._timeout_s:g} s waiting "
                               f"for member {member} of {self.members} (a rank hung or died)")
            expected = ctypes.c_int(seen if seen < 0x80000000 else seen - 0x100000000)  # the word, as a C int
            self._syscall(*self._futex_args[member], ctypes.c_int(_FUTEX_WAIT), expected, self._slice, None,
                          ctypes.c_int(0))


def open_groups(groups: Sequence[tuple[int, ...]], rank: int, token: str, timeout_s: float,
                agree: Callable[[bool], bool]) -> dict[tuple[int, ...], ShmGroup]:
    """Segments for the `groups` (member ranks, in member order) that `rank` belongs to, named after
    `token` (the same on every rank). `agree(ok)` is a collective over every rank: True when all say
    ok. Groups with the same members (a DCP group that is the whole TP group) share one segment. Returns
    {} on every rank when any rank could not create or map a segment (gloo then serves)."""
    paths = {members: SHM_DIR / f"harness-{token}-{i}" for i, members in enumerate(dict.fromkeys(groups))}
    mine = [m for m in paths if rank in m]
    opened: dict[tuple[int, ...], ShmGroup] = {}
    ok = True
    try:
        for members in mine:
            if members[0] == rank:
                opened[members] = ShmGroup.create(paths[members], len(members), 0, timeout_s)
    except OSError:
        ok = False
    if agree(ok):
        try:
            for members in mine:
                if members[0] != rank:
                    opened[members] = ShmGroup.attach(paths[members], len(members), members.index(rank), timeout_s)
        except OSError:
            ok = False
        ok = agree(ok)
    for members in mine:  # every member has mapped it (or given up): the name is no longer needed
        if members[0] == rank and members in opened:
            paths[members].unlink()
    return opened if ok else {}
