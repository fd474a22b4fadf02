"""The engine's collectives on gloo (harness/engine/parallel.py), in real forked ranks: small messages
take the star path (gather at the group's first member, sum in member order, one broadcast), large ones
gloo's own; both give every rank the same all-reduce, within the rounding of tp - 1 additions in the
tensor's dtype of the exact sum, and the all-gathers give every member's tensor in member order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.layout import dcp_members_of
from tests.collectives_worker import SIZES

ROOT = Path(__file__).resolve().parents[1]
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8}


@pytest.mark.parametrize(("world", "dcp"), [(2, 1), (4, 2)])
def test_reduce_and_gathers_on_every_rank(tmp_path: Path, world: int, dcp: int) -> None:
    subprocess.run([sys.executable, "-m", "harness.engine.forkrun", f"--nproc={world}",
                    "--module=tests.collectives_worker", "--", str(tmp_path), str(dcp)],
                   cwd=ROOT, check=True, timeout=600)
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(world)]
    for dtype, u in UNIT_ROUNDOFF.items():
        for size in SIZES:
            key = f"{size}.{dtype}"
            inputs = torch.stack([r[f"{key}.input"] for r in ranks])  # [world, n]
            exact = inputs.double().sum(0)
            bound = (world - 1) * u * inputs.double().abs().sum(0)
            for r, got in enumerate(ranks):
                assert torch.equal(got[f"{key}.reduce"], ranks[0][f"{key}.reduce"]), (key, r)  # every rank alike
                assert ((got[f"{key}.reduce"].double() - exact).abs() <= bound).all(), (key, r)
                assert torch.equal(got[f"{key}.gather"], inputs), (key, r)
                members = list(dcp_members_of(r, dcp))
                assert torch.equal(got[f"{key}.gather_dcp"], inputs[members]), (key, r)
            if size == "large":  # gloo's own all-reduce: the very same tensor
                assert torch.equal(ranks[0][f"{key}.reduce"], ranks[0][f"{key}.ring"]), key
