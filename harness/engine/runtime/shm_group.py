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

Beside its control word each member writes, before its data, a header for the piece (16 bytes, one per
half, double-buffered like the slots): the collective's number on the group, the operation, the dtype
and the element count of the member's whole tensor. After the wait every member compares every header
with its own, so members that called different collectives (another operation, size or dtype) fail at
once with a RunError naming who brought what, the same message on every member, where the bytes alone
would give garbage or a wait until the timeout.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from harness.core.errors import ConfigError, RunError

SHM_ENV = "HARNESS_SHM_COLLECTIVES"  # "1" (default): on where supported; "0": gloo (harness/engine/runtime/parallel.py)
SHM_SETTINGS = ("0", "1")
SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 256 * 1024  # one member's piece of one collective; a segment holds 2 x members slots
WORD_STRIDE = 64  # bytes between control words: one cache line each
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not _PRIVATE) futexes: the words live in several processes
_WAIT_SLICE_S = 1  # a wait wakes at least this often to check its deadline
_MASK = 0xFFFFFFFF  # sequence numbers are 32-bit words, compared modulo 2**32
OPS = ("all_reduce", "all_gather")  # what a collective does with the slots; header code = index + 1
HEADER = struct.Struct("<IHHQ")  # collective number, op code, dtype code, elements of the member's whole tensor
HEADER_OFFSET = 8  # header of half h at word + HEADER_OFFSET + h * HEADER.size, in the control word's cache line
_DTYPES = tuple(dict.fromkeys(v for v in vars(torch).values() if isinstance(v, torch.dtype)))  # code = index + 1
_DTYPE_CODES = {dtype: i + 1 for i, dtype in enumerate(_DTYPES)}


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
                          f"the ranks of one machine, the default) or 0 (gloo)")
    return setting != "0" and supported()


def segment_bytes(members: int) -> int:
    """Control words, then two halves of `members` slots each."""
    return members * WORD_STRIDE + 2 * members * SLOT_BYTES


def describe(header: tuple[int, int, int, int]) -> str:
    """A header as the error names it: "all_gather of 4096 float32"."""
    _, op, dtype, numel = header
    op_name = OPS[op - 1] if 0 < op <= len(OPS) else f"operation #{op}"
    dtype_name = str(_DTYPES[dtype - 1]).removeprefix("torch.") if 0 < dtype <= len(_DTYPES) else f"dtype #{dtype}"
    return f"{op_name} of {numel} {dtype_name}"


def ranks_text(ranks: tuple[int, ...]) -> str:
    """Ranks as errors name them: "ranks 0-3" when consecutive, else "ranks 0, 2, 5" (one: "rank 2")."""
    if len(ranks) > 1 and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "rank " + str(ranks[0]) if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


class ShmGroup:
    """One process group's segment, as mapped by member `index` of `ranks` (global ranks in member order);
    `name` ("TP group") is what errors call it."""

    def __init__(self, segment: mmap.mmap, ranks: tuple[int, ...], index: int, timeout_s: float,
                 name: str = "group") -> None:
        self._segment = segment  # kept: the tensor below views its memory
        # a normal tensor even when the group is made inside an engine call (torch.inference_mode): collectives
        # outside one (`harness serve`'s lockstep agreement) write into views of it
        with torch.inference_mode(False):
            self._bytes = torch.frombuffer(segment, dtype=torch.uint8)  # [segment_bytes(members)]
        self.ranks = ranks
        self.members = len(ranks)
        self.index = index
        self.name = name
        self._timeout_s = timeout_s
        base = self._bytes.data_ptr()
        self._words = [base + j * WORD_STRIDE for j in range(self.members)]
        self._seq = [ctypes.c_uint32.from_address(a) for a in self._words]
        self._headers = [[j * WORD_STRIDE + HEADER_OFFSET + h * HEADER.size for j in range(self.members)]
                         for h in (0, 1)]  # [half][member] -> the header's offset in the segment
        self._mine = [offsets[index] for offsets in self._headers]  # [half] -> this member's header
        self._count = 0  # exchanges (slot-sized pieces) done on this group
        self._collectives = 0  # collectives (calls of pieces) done on this group
        self._views: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}  # (half, numel, dtype) -> slots
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._futex_args = [(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(a)) for a in self._words]
        self._wake = (ctypes.c_int(_FUTEX_WAKE), ctypes.c_int(0x7FFFFFFF), None, None, ctypes.c_int(0))
        self._slice = ctypes.byref(_Timespec(_WAIT_SLICE_S, 0))

    @classmethod
    def create(cls, path: Path, ranks: tuple[int, ...], index: int, timeout_s: float,
               name: str = "group") -> "ShmGroup":
        """The group's first member: a new segment file (only this user may open it), its memory
        reserved now so a full /dev/shm fails here (OSError) rather than with SIGBUS mid-run."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, segment_bytes(len(ranks)))
            return cls(mmap.mmap(fd, segment_bytes(len(ranks))), ranks, index, timeout_s, name)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, path: Path, ranks: tuple[int, ...], index: int, timeout_s: float,
               name: str = "group") -> "ShmGroup":
        """Another member: map the segment the first member created."""
        fd = os.open(path, os.O_RDWR)
        try:
            return cls(mmap.mmap(fd, segment_bytes(len(ranks))), ranks, index, timeout_s, name)
        finally:
            os.close(fd)

    def pieces(self, x: torch.Tensor, op: str) -> Iterator[tuple[int, torch.Tensor]]:
        """Exchange x's flattened elements slot by slot for collective `op` (one of OPS): yields (offset,
        every member's piece [members, n] in member order), a view of the segment valid until the next
        step of the iteration. A member that brought another op, element count or dtype: RunError."""
        self._collectives += 1
        mine = HEADER.pack(self._collectives & _MASK, OPS.index(op) + 1, _DTYPE_CODES[x.dtype], x.numel())
        flat = x.reshape(-1)  # [numel]
        step = SLOT_BYTES // x.element_size()
        for start in range(0, max(1, flat.numel()), step):
            yield start, self._exchange(flat[start:start + step], mine)

    def _exchange(self, piece: torch.Tensor, header: bytes) -> torch.Tensor:
        self._count += 1
        k = self._count & _MASK
        half = self._count % 2
        segment = self._segment
        at = self._mine[half]
        segment[at:at + HEADER.size] = header
        slots = self._slots(half, piece.numel(), piece.dtype)  # [members, n]
        slots[self.index].copy_(piece)
        self._seq[self.index].value = k  # after the header and data: x86-64 keeps stores in order
        self._syscall(*self._futex_args[self.index], *self._wake)
        for j in range(self.members):
            self._wait_for(j, k)
        for at in self._headers[half]:  # loads after seeing k see what each member stored before k
            if segment[at:at + HEADER.size] != header:
                raise self._disagreement(half)
        return slots

    def _disagreement(self, half: int) -> RunError:
        """Which members brought another collective than most (ties: than the first member) in `half`."""
        brought = [HEADER.unpack_from(self._segment, at) for at in self._headers[half]]  # [member]
        usual = max(brought, key=lambda h: (brought.count(h), -brought.index(h)))

        def who(j: int) -> str:
            rank = self.ranks[j]
            return f"rank {rank}" if rank == j else f"rank {rank} (member {j})"

        odd = [f"{who(j)} brought " + describe(h) + (f" as collective {h[0]}" if h[0] != usual[0] else "")
               for j, h in enumerate(brought) if h != usual]
        alike = tuple(self.ranks[j] for j, h in enumerate(brought) if h == usual)
        return RunError(f"collective {usual[0]} on {self.name} ({ranks_text(self.ranks)}): " + "; ".join(odd)
                        + f"; {ranks_text(alike)} brought {describe(usual)}")

    def _slots(self, half: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Every member's slot in `half` as [members, numel] of `dtype` (rows SLOT_BYTES apart); made once
        per size."""
        key = (half, numel, dtype)
        if key not in self._views:
            size = dtype.itemsize
            with torch.inference_mode(False):  # kept views: normal tensors wherever first made (see __init__)
                whole = self._bytes[: self._bytes.numel() // size * size].view(dtype)  # the segment as dtype
                start = (self.members * WORD_STRIDE + half * self.members * SLOT_BYTES) // size
                self._views[key] = whole.as_strided((self.members, numel), (SLOT_BYTES // size, 1), start)
        return self._views[key]

    def _wait_for(self, member: int, k: int) -> None:
        """Until `member` has published exchange k (or a later one) or the timeout passes."""
        word = self._seq[member]
        deadline = 0.0
        while True:
            seen = word.value
            if (seen - k) & _MASK < 0x80000000:
                return
            if not deadline:
                deadline = time.monotonic() + self._timeout_s
            elif time.monotonic() > deadline:
                raise RunError(f"shared-memory collective {self._collectives} on {self.name} "
                               f"({ranks_text(self.ranks)}) timed out after {self._timeout_s:g} s waiting for member "
                               f"{member} of {self.members} (rank {self.ranks[member]}; a rank hung or died)")
            expected = ctypes.c_int(seen if seen < 0x80000000 else seen - 0x100000000)  # the word, as a C int
            self._syscall(*self._futex_args[member], ctypes.c_int(_FUTEX_WAIT), expected, self._slice, None,
                          ctypes.c_int(0))


def open_groups(groups: Mapping[tuple[int, ...], str], rank: int, token: str, timeout_s: float,
                agree: Callable[[bool], bool]) -> dict[tuple[int, ...], ShmGroup]:
    """Segments for the `groups` (member ranks, in member order -> the group's name in errors) that `rank`
    belongs to, named after `token` (the same on every rank). `agree(ok)` is a collective over every rank:
    True when all say ok. Groups with the same members (a DCP group that is the whole TP group) are one
    entry, one segment. Returns {} on every rank when any rank could not create or map a segment (gloo
    then serves)."""
    paths = {members: SHM_DIR / f"harness-{token}-{i}" for i, members in enumerate(groups)}
    mine = [m for m in paths if rank in m]
    opened: dict[tuple[int, ...], ShmGroup] = {}
    ok = True
    try:
        for members in mine:
            if members[0] == rank:
                opened[members] = ShmGroup.create(paths[members], members, 0, timeout_s, groups[members])
    except OSError:
        ok = False
    if agree(ok):
        try:
            for members in mine:
                if members[0] != rank:
                    opened[members] = ShmGroup.attach(paths[members], members, members.index(rank), timeout_s,
                                                      groups[members])
        except OSError:
            ok = False
        ok = agree(ok)
    for members in mine:  # every member has mapped it (or given up): the name is no longer needed
        if members[0] == rank and members in opened:
            paths[members].unlink()
    return opened if ok else {}
