"""The engine's collectives on the CPU (harness/engine/runtime/parallel.py), in real forked ranks, on both paths:
shared memory among the ranks of one machine (the default; harness/engine/runtime/shm_group.py) and gloo
(HARNESS_SHM_COLLECTIVES=0: gloo's all_gather, and for an all-reduce a sum of it in member order). Both
give every rank the same all-reduce, within the rounding of tp - 1 additions in the tensor's dtype of the
exact sum, and exactly the member-order sum (slot-sized pieces and all), so the two paths are
bit-identical; the all-gathers give every member's tensor in member order. On shared memory a member
that never arrives is a RunError after the collective timeout, not a hang, and members that bring
different collectives (operation, size, dtype) all fail at once with a RunError naming who brought what."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.core.errors import ConfigError
from harness.engine.runtime import shm_group
from harness.partition.layout import dcp_members_of
from tests.collectives_worker import HANG_TIMEOUT_S, LARGE, MATCHED, MISMATCH_TIMEOUT_S, SIZES

ROOT = Path(__file__).resolve().parents[1]
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8}
needs_shm = pytest.mark.skipif(not shm_group.supported(), reason="shared-memory collectives need Linux x86-64")


def _run(tmp_path: Path, world: int, dcp: int, shm: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness.launcher.forkrun", f"--nproc={world}",
                           f"--log-dir={tmp_path / 'logs'}", "--module=tests.collectives_worker", "--",
                           str(tmp_path), str(dcp), *extra],
                          cwd=ROOT, env={**os.environ, shm_group.SHM_ENV: shm}, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("shm", ["1", "0"])
@pytest.mark.parametrize(("world", "dcp"), [(2, 1), (2, 2), (4, 2)])  # (2, 2): the DCP group is the TP group
def test_reduce_and_gathers_on_every_rank(tmp_path: Path, world: int, dcp: int, shm: str) -> None:
    if shm == "1" and not shm_group.supported():
        pytest.skip("shared-memory collectives need Linux x86-64")
    assert _run(tmp_path, world, dcp, shm).returncode == 0
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(world)]
    assert all(int(r["shm"]) == int(shm) for r in ranks)  # the path asked for is the path taken
    for dtype, u in UNIT_ROUNDOFF.items():
        for size in SIZES:
            key = f"{size}.{dtype}"
            inputs = torch.stack([r[f"{key}.input"] for r in ranks])  # [world, n]
            exact = inputs.double().sum(0)
            bound = (world - 1) * u * inputs.double().abs().sum(0)
            in_order = inputs[0].clone()
            for part in inputs[1:]:
                in_order += part  # member order, rounding in the dtype per add
            even = inputs.shape[1] // 2 * 2
            for r, got in enumerate(ranks):
                assert torch.equal(got[f"{key}.reduce"], ranks[0][f"{key}.reduce"]), (key, r)  # every rank alike
                assert ((got[f"{key}.reduce"].double() - exact).abs() <= bound).all(), (key, r)
                assert torch.equal(got[f"{key}.reduce"], in_order), (key, r)  # either path: the member-order sum
                assert torch.equal(got[f"{key}.reduce_2d_t"], in_order[:even].view(2, -1).t()), (key, r)
                assert torch.equal(got[f"{key}.gather"], inputs), (key, r)
                members = list(dcp_members_of(r, dcp))
                assert torch.equal(got[f"{key}.gather_dcp"], inputs[members]), (key, r)
                halves = inputs[members][:, :even].view(len(members), 2, -1)  # [dcp, 2, n/2]
                assert torch.equal(got[f"{key}.gather_dcp_2d"], torch.cat(halves.unbind(0), dim=1)), (key, r)


@needs_shm
def test_a_member_that_never_arrives_is_a_timeout_error(tmp_path: Path) -> None:
    done = _run(tmp_path, 3, 1, "1", "hang")
    assert done.returncode != 0
    assert "first failure: rank 0" in done.stdout or "first failure: rank 1" in done.stdout
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert f"timed out after {HANG_TIMEOUT_S:g} s waiting for member 2 of 3" in log


ODD = "collective 3 on TP group (ranks 0-2): rank 1 brought {}; ranks 0, 2 brought all_reduce of 256 float32"
MISMATCH_CASES = {  # kind -> (world, dcp, {rank: what its collective ended with})
    "same": (3, 1, {r: "ok" for r in range(3)}),
    "op": (3, 1, {r: "RunError: " + ODD.format(f"all_gather of {MATCHED} float32") for r in range(3)}),
    "size": (3, 1, {r: "RunError: " + ODD.format(f"all_reduce of {LARGE} float32") for r in range(3)}),
    "dtype": (3, 1, {r: "RunError: " + ODD.format(f"all_reduce of {MATCHED} bfloat16") for r in range(3)}),
    "dcp": (4, 2, {0: "ok", 1: "ok", **{r: "RunError: collective 2 on DCP group (ranks 2-3): rank 3 (member 1) brought "
                                        f"all_gather of {MATCHED} bfloat16; rank 2 brought all_gather of {MATCHED} "
                                        "float32" for r in (2, 3)}}),
}


@needs_shm
@pytest.mark.parametrize("kind", list(MISMATCH_CASES))
def test_members_that_bring_different_collectives_all_fail_at_once(tmp_path: Path, kind: str) -> None:
    """One member calls another operation, size or dtype than the others (after matching
    ones): every member of that group raises the same RunError naming it, what it brought and
    what the others brought, within seconds rather than at the collective timeout; the other group of
    a DCP run and a run without an odd member go on as before."""
    world, dcp, expected = MISMATCH_CASES[kind]
    done = _run(tmp_path, world, dcp, "1", "mismatch", kind)
    assert done.returncode == 0, done.stdout
    for rank, want in expected.items():
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["shm"] and got["result"] == want, (rank, got)
        assert got["seconds"] < MISMATCH_TIMEOUT_S / 10, (rank, got)


def test_setting_is_checked() -> None:
    with pytest.raises(ConfigError, match="HARNESS_SHM_COLLECTIVES='yes'.*valid: 1 .* or 0"):
        shm_group.enabled("yes")
    assert not shm_group.enabled("0")
    assert shm_group.enabled(None) == shm_group.enabled("1") == shm_group.supported()


@needs_shm
def test_a_segment_that_cannot_be_made_leaves_every_rank_on_gloo(tmp_path: Path) -> None:
    """The name is taken (a segment file exists): creation fails, every rank agrees on none, the
    taken file is left alone, and no segment file of the attempt remains."""
    token = f"test{os.getpid()}"
    taken = shm_group.SHM_DIR / f"harness-{token}-0"
    taken.write_bytes(b"someone else's")
    try:
        votes: list[bool] = []

        def agree(ok: bool) -> bool:
            votes.append(ok)
            return ok

        assert shm_group.open_groups({(0,): "TP group"}, 0, token, 1.0, agree) == {}
        assert votes == [False]
        assert taken.read_bytes() == b"someone else's"
    finally:
        taken.unlink()
    assert not list(shm_group.SHM_DIR.glob(f"harness-{token}-*"))


@pytest.mark.parametrize("topo", ["tp2dcp2", "tp4dcp2"])  # tp4: gloo's own all_reduce would add in another order
def test_a_run_on_shared_memory_equals_the_same_run_on_gloo(tmp_path: Path, topo: str) -> None:
    """A whole run (all-reduces, Q gathers, LSE-merge gathers, logits gathers): shared memory and gloo's
    all_gather sum in the same member order, so every tensor of the run is bit-identical; the manifest
    says which path ran."""
    from tests.conftest import launch_run

    runs = {s: launch_run(tmp_path / s, "tiny-gqa", topo, env={shm_group.SHM_ENV: s}) for s in ("1", "0")}
    assert runs["0"].ok and runs["0"].manifest["collectives"] == "gloo"
    assert runs["1"].ok and runs["1"].manifest["collectives"] == ("shm" if shm_group.supported() else "gloo")
    assert runs["1"].tensors.keys() == runs["0"].tensors.keys() and runs["1"].tensors
    for key, got in runs["1"].tensors.items():
        assert torch.equal(got, runs["0"].tensors[key]), key
