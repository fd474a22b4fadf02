"""The reference cache's integrity and sharing: checksummed entries (a tampered tensor is launched
again, never trusted), a noise floor implausible for its dtype is a WARN, the per-user default folder,
and two `harness run` processes at once on one cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.cli import main
from harness.compare.parity.bounds import NOISE_PLAUSIBLE_ROUNDOFFS, UNIT_ROUNDOFF, NoiseLimit
from harness.compare.parity.logits import check_logits
from harness.compare.settings import LogitsSettings, parse_section
from harness.core.errors import ConfigError
from harness.core.paths import CACHE_NAME, default_cache_dir
from harness.core.verdict import Verdict
from harness.flow.refcache import CHECKSUMS_FILE, PARTIAL_SUFFIX, checksum_problem
from harness.records.artifacts import RunArtifacts

ROOT = Path(__file__).resolve().parent.parent
SUITE = """
name: integrity
version: 1
models: [tiny-gqa]
topologies: [tp2]
max_new_tokens: 4
decode_prefix_tokens: 2
kv_budget_mib: 4
max_seq_len: 64
prompts: ["The capital of France is", "Q: 17 + 25 = ?\\nA:"]
checks: {layout: {}, logits: {}}
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _verdict(results: Path, check: str) -> str:
    import json
    cell, = json.loads(results.read_text())["cells"]
    return next(c["verdict"] for c in cell["checks"] if c["name"] == check)


def _reference_entry(cache: Path) -> Path:
    ref, = [p for p in (cache / "runs").iterdir() if "noise" not in p.name]
    return ref


def _tamper(entry: Path, n: int = 100) -> None:
    """Zero `n` floats of prompt 0's prefill logits, header and shapes intact."""
    path = entry / "tensors.safetensors"
    tensors = load_file(str(path))
    logits = tensors["prefill_logits.0"]
    top = logits.flatten().abs().topk(n).indices  # the largest logits: what moves the noise floor most
    logits.view(-1)[top] = 0.0
    size = path.stat().st_size
    save_file(tensors, str(path))
    assert path.stat().st_size == size  # same header, same length: only the values changed


def test_tampered_entry_is_launched_again_and_the_fault_still_fails(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    suite = tmp_path / "integrity.yaml"
    suite.write_text(SUITE)
    cache = tmp_path / "cache"
    args = ["run", "--suite", str(suite), "--cache-dir", str(cache)]
    assert main([*args, "--out", str(tmp_path / "clean"), "--fault", "fp16-attn-allreduce"]) == 1
    assert _verdict(tmp_path / "clean" / "results.json", "logits_prefill") == "FAIL"  # clean cache: FAIL
    entry = _reference_entry(cache)
    assert checksum_problem(entry) is None and (entry / CHECKSUMS_FILE).is_file()

    capsys.readouterr()  # negative control: an untouched entry is reused
    assert main([*args, "--out", str(tmp_path / "again")]) == 0
    out = capsys.readouterr().out
    assert f"cached ({entry})" in out and ": running" not in out

    _tamper(entry)
    assert checksum_problem(entry) == "tensors.safetensors"
    assert main([*args, "--out", str(tmp_path / "tampered"), "--fault", "fp16-attn-allreduce"]) == 1
    out = capsys.readouterr().out
    assert f"cached entry {entry.name} failed its checksum (tensors.safetensors); launching again" in out
    assert _verdict(tmp_path / "tampered" / "results.json", "logits_prefill") == "FAIL"
    assert checksum_problem(entry) is None  # relaunched and recorded again

    (entry / CHECKSUMS_FILE).unlink()  # an entry without checksums is not trusted either
    assert main([*args, "--out", str(tmp_path / "nosums")]) == 0
    assert f"failed its checksum (no {CHECKSUMS_FILE})" in capsys.readouterr().out


def _run(tmp: Path, name: str, dtype: str, logits: list[list[float]]) -> RunArtifacts:
    import torch

    from harness.records.artifacts import Case
    case = Case(index=0, prompt="x", prompt_ids=(1,), sequence_ids=(1, 2), decode_start=1, probe_positions=(0,))
    return RunArtifacts(path=tmp / name, manifest={"status": "ok", "dtype": dtype}, cases=[case],
                        tensors={"prefill_logits.0": torch.tensor(logits, dtype=torch.float32)})


def test_noise_plausibility_rule() -> None:
    """Limit = 2^10 x u(dtype) x max |logit|: the shipped models' clean noise (~13 u x max |logit|) passes
    with a wide margin, a corrupted one does not, in every dtype; KL by Hoeffding from the abs limit."""
    measured = {"float32": (1.48e-5, 18.8), "float16": (0.1035, 21.3), "bfloat16": (1.008, 20.1)}  # clean runs
    for dtype, (clean_abs, magnitude) in measured.items():
        limit = NoiseLimit(dtype, magnitude)
        assert limit.abs_limit == NOISE_PLAUSIBLE_ROUNDOFFS * UNIT_ROUNDOFF[dtype] * magnitude
        assert limit.problem(clean_abs, 0.5 * clean_abs ** 2) is None  # negative control
        assert limit.abs_limit > 40 * clean_abs  # margin
        assert limit.problem(2 * limit.abs_limit, 0.0) is not None  # positive control
    f32 = NoiseLimit("float32", 18.8)
    assert 1e-7 < f32.kl_limit < 1e-6  # "float32 KL noise above ~1e-6 is implausible"
    assert "max KL 1.5e+00" in (f32.problem(1e-5, 1.5) or "")  # the corrupted floor


def test_implausible_noise_run_warns_and_bounds_fall_back(tmp_path: Path) -> None:
    settings = parse_section(LogitsSettings, "logits", {}, "float32")
    ref = _run(tmp_path, "ref", "float32", [[10.0, 2.0, -3.0], [1.0, 8.0, 0.5]])
    par = _run(tmp_path, "par", "float32", [[10.0, 2.0, -3.0], [1.0, 8.0, 0.5]])
    clean = _run(tmp_path, "noise", "float32", [[10.0 + 1e-6, 2.0, -3.0], [1.0, 8.0, 0.5 - 1e-6]])
    broken = _run(tmp_path, "noise-broken", "float32", [[0.0, 2.0, -3.0], [1.0, 8.0, 0.5]])
    ok, _ = check_logits("prefill", ref, par, clean, settings)
    assert ok.verdict == Verdict.PASS and not ok.metrics["noise_implausible"]
    warn, _ = check_logits("prefill", ref, par, broken, settings)
    assert warn.verdict == Verdict.WARN and warn.metrics["noise_implausible"]
    assert f"noise run {tmp_path / 'noise-broken'} implausible: max abs 1.0e+01" in warn.reason
    assert warn.metrics["abs_bound"]["noise"] is None  # not a bound scaled from the broken run: the dtype's limit
    assert warn.metrics["abs_bound"]["floor"] == NoiseLimit("float32", 10.0).abs_limit
    wrong = _run(tmp_path, "par-wrong", "float32", [[9.9, 2.0, -3.0], [1.0, 8.0, 0.5]])
    fail, _ = check_logits("prefill", ref, wrong, broken, settings)
    assert fail.verdict == Verdict.FAIL  # the broken floor no longer excuses a real error


def test_a_noise_discontinuity_is_measured_before_it(tmp_path: Path) -> None:
    """A noise run that goes beyond rounding from one position on (an MoE routing tie resolved the other way,
    carried by the later positions) measures the noise before it: no WARN, bounds scaled from those positions;
    one beyond rounding from the start of most positions stays implausible."""
    settings = parse_section(LogitsSettings, "logits", {}, "float32")
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(10, 6, generator=g) * 4).tolist()
    late = [[x + (1e-6 if t < 7 else 0.5) * (-1) ** j for j, x in enumerate(row)] for t, row in enumerate(base)]
    ref, par = _run(tmp_path, "ref", "float32", base), _run(tmp_path, "par", "float32", base)
    noise = _run(tmp_path, "noise-late", "float32", late)
    ok, _ = check_logits("prefill", ref, par, noise, settings)
    assert ok.verdict == Verdict.PASS and not ok.metrics["noise_implausible"]
    assert "prompt 0 from compared position 7 on" in ok.metrics["noise_note"]
    assert "on the 7 positions before it" in ok.reason
    assert ok.metrics["abs_bound"]["noise"] == pytest.approx(1e-6, rel=0.1)  # the first 7 positions' noise
    limit = NoiseLimit("float32", max(abs(x) for row in base for x in row)).abs_limit

    def shifted(name: str, row: int, by: float) -> RunArtifacts:
        return _run(tmp_path, name, "float32", [[x + (by if t == row else 0.0) for x in r] for t, r in enumerate(base)])

    tail_ok, _ = check_logits("prefill", ref, shifted("par-tail", 8, 0.5 * limit), noise, settings)
    assert tail_ok.verdict == Verdict.PASS and tail_ok.metrics["tail_rows"] == 3  # rows 7-9: the rounding limit
    assert "3 rows after the noise run's discontinuity" in tail_ok.reason
    tail_bad, _ = check_logits("prefill", ref, shifted("par-tail-bad", 8, 0.1), noise, settings)
    assert tail_bad.verdict == Verdict.FAIL  # beyond rounding after the discontinuity too
    wrong = shifted("par-wrong", 2, 0.01)
    assert check_logits("prefill", ref, wrong, noise, settings)[0].verdict == Verdict.FAIL  # positive control
    early = [[x + (1e-6 if t < 4 else 0.5) * (-1) ** j for j, x in enumerate(row)] for t, row in enumerate(base)]
    warn, _ = check_logits("prefill", ref, par, _run(tmp_path, "noise-early", "float32", early), settings)
    assert warn.verdict == Verdict.WARN and warn.metrics["noise_implausible"]  # 4 of 10 plausible: not a tail


def test_default_cache_dir_is_private_and_per_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HARNESS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = default_cache_dir()
    assert path == tmp_path / "xdg" / CACHE_NAME and path.is_dir() and path.stat().st_mode & 0o777 == 0o700
    os.chmod(path, 0o755)  # an existing one of this user is made private
    assert default_cache_dir().stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / CACHE_NAME
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "given"))
    assert default_cache_dir() == tmp_path / "given"  # as given: a deliberately shared folder is allowed
    monkeypatch.delenv("HARNESS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/")  # "/llm-parallel-harness" cannot be created by a user ...
    if os.getuid() != 0:
        with pytest.raises(ConfigError, match=f"cache folder /{CACHE_NAME}"):
            default_cache_dir()
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)  # ... nor used when another's
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(ConfigError, match=f"cache folder {tmp_path / 'xdg' / CACHE_NAME} belongs to another user"):
        default_cache_dir()


def test_two_processes_at_once_share_one_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    argv = ["--suite", "dcp", "--topo", "tp2dcp2", "--model", "tiny-gqa", "--workload", "prompts",
            "--cache-dir", str(cache)]
    procs = [subprocess.Popen([sys.executable, "-m", "harness", "run", *argv, "--out", str(tmp_path / f"out{i}")],
                              cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        assert "SHIPPABLE" in out and _verdict(tmp_path / f"out{procs.index(p)}" / "results.json",
                                              "logits_prefill") == "PASS"
    entries = sorted((cache / "runs").iterdir())
    assert not [e for e in entries if e.name.endswith(PARTIAL_SUFFIX)]
    assert len(entries) == 2  # one reference and one noise run, each once
    assert all(checksum_problem(e) is None for e in entries)
    both = "\n".join(outs)
    assert both.count("reference tiny-gqa tp1 float32 seed 0: running") == 1  # the lock: paid for once
    assert both.count("noise tiny-gqa tp1 float32 seed 0: running") == 1

