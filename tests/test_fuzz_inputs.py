"""Fuzzing the input parsers with hypothesis (bounded, no network): random topology names, mutated suite
and model YAML, and command lines of `plan` and of a `run` that always fails validation (an unknown
engine is checked last, so nothing ever launches). Each either gives a valid result or one ConfigError
/ one `harness: error:` line with exit 2; never a traceback."""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.checks.settings import load_suite
from harness.cli import main
from harness.errors import ConfigError
from harness.paths import MODELS_DIR, SUITES_DIR
from harness.specs.checkpoint import load_model
from harness.specs.model import ModelSpec
from harness.specs.suite import Suite, read_suite
from harness.specs.topology import Topology, load_catalog, parse_topology_name

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CATALOG = load_catalog()
TOPO_TEXT = st.text(alphabet="tpdcmraf-0123456789, all", max_size=24) | st.text(max_size=12)
SUITE_TEXT = (SUITES_DIR / "dcp.yaml").read_text()
MODEL_TEXT = (MODELS_DIR / "tiny-gqa.yaml").read_text()


@st.composite
def mutated(draw: st.DrawFn, text: str) -> bytes:
    """`text` with a few random edits: a slice deleted, a string inserted, a line duplicated, a byte flipped."""
    data = text.encode()
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["delete", "insert", "flip", "line"]))
        at = draw(st.integers(0, len(data)))
        if kind == "delete":
            data = data[:at] + data[at + draw(st.integers(1, 40)):]
        elif kind == "insert":
            piece = draw(st.sampled_from([": ", "- ", "\n", "[", "{", "'", "-1", "0", "null", "tp3", "x: [1, 2]",
                                          "\t", "&a", "*a", "!!python/object:os.system", "\x00", "\xff", "1e999"]))
            data = data[:at] + piece.encode("utf-8", "surrogateescape") + data[at:]
        elif kind == "flip" and data:
            at = min(at, len(data) - 1)
            data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
        else:
            lines = data.split(b"\n")
            i = min(at, len(lines) - 1)
            data = b"\n".join(lines[:i + 1] + lines[i:])
    return data


def _file(folder: str, name: str, data: bytes) -> Path:
    path = Path(folder) / name
    path.write_bytes(data)
    return path


@FUZZ
@given(TOPO_TEXT)
def test_topology_names_parse_or_raise_config_error(name: str) -> None:
    for parse in (parse_topology_name, CATALOG.resolve):
        try:
            result = parse(name)
        except ConfigError as exc:
            assert str(exc) and "\n" not in str(exc)
        else:
            assert all(isinstance(t, Topology) for t in (result if isinstance(result, list) else [result]))


@FUZZ
@given(mutated(SUITE_TEXT))
def test_mutated_suites_load_or_raise_config_error(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = _file(folder, "fuzz.yaml", data)
        for load in (read_suite, load_suite):
            try:
                assert isinstance(load(str(path)), Suite)
            except ConfigError as exc:
                assert str(exc)


@FUZZ
@given(mutated(MODEL_TEXT))
def test_mutated_models_load_or_raise_config_error(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = _file(folder, "fuzz.yaml", data)
        try:
            assert isinstance(load_model(str(path)), ModelSpec)
        except ConfigError as exc:
            assert str(exc)


def _cli(argv: list[str]) -> tuple[int, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse: usage errors
            code = int(exc.code or 0)
    return code, err.getvalue()


def _one_error_or_ok(code: int, err: str) -> None:
    assert "Traceback" not in err and "internal error" not in err, err
    assert code in (0, 2), (code, err)
    if code == 2:
        assert len([line for line in err.splitlines() if line.startswith("harness: error:")]) == 1, err


NUMBER = st.sampled_from(["1", "0", "-1", "0.5", "nan", "inf", "1e9", "x", "", "64"])


@SMALL
@given(model=st.sampled_from(["tiny-gqa", "tiny-kv6", "tiny-9h3kv", "nope", "", "x.yaml", "/dev/null"]),
       topo=TOPO_TEXT, budget=st.none() | NUMBER, seq=st.none() | NUMBER,
       fmt=st.sampled_from(["table", "json", "xml"]))
def test_plan_command_lines(model: str, topo: str, budget: str | None, seq: str | None, fmt: str) -> None:
    argv = ["plan", "--model", model, "--topo", topo, "--format", fmt]
    argv += ["--budget-gib", budget] if budget is not None else []
    argv += ["--max-seq-len", seq] if seq is not None else []
    _one_error_or_ok(*_cli(argv))


@SMALL
@given(suite=st.none() | mutated(SUITE_TEXT), topo=st.none() | TOPO_TEXT,
       seeds=st.lists(st.sampled_from(["0", "1", "-1", "x", "99999999999"]), max_size=2),
       model=st.none() | st.sampled_from(["tiny-gqa", "nope", "tiny-kv6"]),
       budget=st.none() | NUMBER, profile=st.none() | st.sampled_from(["nightly", "nope"]))
def test_run_command_lines_that_fail_validation(suite: bytes | None, topo: str | None, seeds: list[str],
                                                model: str | None, budget: str | None, profile: str | None) -> None:
    with tempfile.TemporaryDirectory() as folder:
        argv = ["run", "--suite", str(_file(folder, "suite.yaml", suite)) if suite is not None else "dcp",
                "--out", f"{folder}/out", "--cache-dir", f"{folder}/cache", "--engine", "no-such-engine"]
        argv += ["--topo", topo] if topo is not None else []
        argv += [x for s in seeds for x in ("--seed", s)]
        argv += ["--model", model] if model is not None else []
        argv += ["--kv-budget-mib", budget] if budget is not None else []
        argv += ["--profile", profile] if profile is not None else []
        code, err = _cli(argv)
        _one_error_or_ok(code, err)
        assert code == 2, err  # the unknown engine at the latest: never a launch
        assert not (Path(folder) / "cache" / "runs").exists()
