"""Fuzzing every parser and file reader with hypothesis (bounded, no network, in the default test run):
random topology names and mutated topology catalogs, suite, model and engine YAML, results.json (report,
history add, baseline update, signoff), history databases, GSM8K and acceptance baselines, reference-cache
entries, server answers of the three HTTP dialects, and command lines of `plan`, of a `run` that always
fails validation (an unknown engine is checked last, so nothing ever launches) and of `serve` (its port held, so
nothing ever listens; P/D store paths that are files, missing or folders). Each either gives a valid
result or the project's one clear error (ConfigError / `harness: error:` with exit 2; RunError for a server's
answer; a cache entry launched again); never a traceback. Example counts are modest so CI stays cheap."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.backends.http.dialects import DIALECTS
from harness.baselines.acceptance_baseline import read_acceptance
from harness.baselines.baseline import read_baselines
from harness.checks.settings import load_suite
from harness.cli import main
from harness.core.errors import ConfigError, RunError
from harness.core.paths import BASELINES_DIR, MODELS_DIR, PROJECT_ROOT, SUITES_DIR, TOPOLOGIES_DIR
from harness.formats.locate import load_model
from harness.specs.engine import EngineSpec, load_engine
from harness.specs.model import ModelSpec
from harness.specs.suite import Suite, read_suite
from harness.specs.topology import Topology, TopologyCatalog, load_catalog, parse_topology_name
from tests.report_fixtures import RESULTS_DIR

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CATALOG = load_catalog()
TOPO_TEXT = st.text(alphabet="tpdcmraf-0123456789, all", max_size=24) | st.text(max_size=12)
SUITE_TEXT = (SUITES_DIR / "dcp.yaml").read_text()
MODEL_TEXT = (MODELS_DIR / "tiny-gqa.yaml").read_text()
ENGINE_TEXTS = [(PROJECT_ROOT / "engines" / f"{n}.yaml").read_text() for n in ("harness-serve", "vllm", "openai")]
CATALOG_TEXT = (TOPOLOGIES_DIR / "default.yaml").read_text()
RESULTS_TEXTS = [(RESULTS_DIR / k / "results.json").read_text() for k in ("clean", "error", "skip")]
BASELINE_TEXTS = {"gsm8k": (BASELINES_DIR / "gsm8k.yaml").read_text(),
                  "acceptance": (BASELINES_DIR / "acceptance.yaml").read_text()}


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


def _any_mutated(texts: list[str]) -> st.SearchStrategy[bytes]:
    return st.sampled_from(texts).flatmap(mutated)


@FUZZ
@given(_any_mutated(ENGINE_TEXTS))
def test_mutated_engine_templates_load_or_raise_config_error(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        try:
            assert isinstance(load_engine(str(_file(folder, "fuzz.yaml", data))), EngineSpec)
        except ConfigError as exc:
            assert str(exc)


@FUZZ
@given(mutated(CATALOG_TEXT))
def test_mutated_topology_catalogs_load_or_raise_config_error(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        _file(folder, "fuzz.yaml", data)
        try:
            assert isinstance(load_catalog((Path(folder),)), TopologyCatalog)
        except ConfigError as exc:
            assert str(exc)


@SMALL
@given(kind=st.sampled_from(sorted(BASELINE_TEXTS)), data=st.data())
def test_mutated_baselines_load_or_raise_config_error(kind: str, data: st.DataObject) -> None:
    text = data.draw(mutated(BASELINE_TEXTS[kind]))
    with tempfile.TemporaryDirectory() as folder:
        path = _file(folder, f"{kind}.yaml", text)
        try:
            read_acceptance(path) if kind == "acceptance" else read_baselines(path)
        except ConfigError as exc:
            assert str(exc)


@FEW
@given(data=_any_mutated(RESULTS_TEXTS), command=st.sampled_from(["report", "history", "baseline", "signoff"]))
def test_mutated_results_files_are_read_or_one_error(data: bytes, command: str) -> None:
    """A damaged results.json in every command that reads one: its report, a recorded history, a baseline update,
    a sign-off: the command's own exit code, or one error line with exit 2."""
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        run.mkdir()
        _file(str(run), "results.json", data)
        argv = {"report": ["report", str(run), "--out", f"{folder}/out"],
                "history": ["history", "add", str(run), "--history", f"{folder}/h.db"],
                "baseline": ["baseline", "update", "--from", str(run), "--dir", f"{folder}/b"],
                "signoff": ["signoff", "--candidate", str(run), "--baseline", str(RESULTS_DIR / "corruption"),
                            "--out", f"{folder}/so"]}[command]
        code, err = _cli(argv)
        assert "Traceback" not in err and "internal error" not in err, err
        if code == 2:
            assert len([line for line in err.splitlines() if line.startswith("harness: error:")]) == 1, err
        else:  # read: the command's verdict (report: 0 / 1 / 3, baseline: 0 / 1, signoff: 0 / 1)
            assert code in (0, 1, 3), (code, err)


@functools.lru_cache(maxsize=1)
def _history_bytes() -> bytes:
    """A history database holding three recorded runs, as bytes."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "h.db"
        code, err = _cli(["history", "add", *(str(RESULTS_DIR / k) for k in ("clean", "error", "skip")),
                          "--history", str(path)])
        assert code == 0, err
        return path.read_bytes()


@FEW
@given(st.data())
def test_mutated_history_databases_are_shown_or_one_error(data: st.DataObject) -> None:
    raw = bytearray(_history_bytes())
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.sampled_from([len(raw), len(raw) // 2, 100, 0]))
    with tempfile.TemporaryDirectory() as folder:
        path = _file(folder, "h.db", bytes(raw[:cut]))
        for argv in (["history", "show", "--history", str(path)],
                     ["history", "add", str(RESULTS_DIR / "clean"), "--history", str(path)]):
            code, err = _cli(argv)
            assert "Traceback" not in err and "internal error" not in err, (argv, err)
            assert code in (0, 1, 2), (argv, code, err)


@functools.lru_cache(maxsize=1)
def _cached_entry() -> Path:
    """A real reference-cache entry: tiny-gqa at tp1 run by the embedded engine into a reference cache."""
    from harness.backends.registry import get_backend
    from harness.flow.refcache import ReferenceCache
    from harness.records.contract import Job

    folder = Path(tempfile.mkdtemp(prefix="fuzz-cache-"))
    cache = ReferenceCache(folder, get_backend("embedded"), 300, lambda _: None)
    job = Job(model=load_model("tiny-gqa"), topology=parse_topology_name("tp1"), prompts=["hi there"], out_dir=".",
              max_new_tokens=2, decode_prefix_tokens=1)
    return cache.get(job, "tiny-gqa-tp1-float32", "reference").path


ENTRY_FILES = ("manifest.json", "cases.json", "layout.json", "job.json", "tensors.safetensors", "checksums.json")


@FEW
@given(name=st.sampled_from(ENTRY_FILES), data=st.data(), rehash=st.booleans())
def test_mutated_cache_entries_are_used_or_launched_again(name: str, data: st.DataObject, rehash: bool) -> None:
    """A damaged entry is read (it still passes) or reported and launched again: never an exception. With
    `rehash` its checksums are recomputed, so the readers behind the checksum see the damage too."""
    from harness.flow.refcache import ReferenceCache, write_checksums

    with tempfile.TemporaryDirectory() as folder:
        entry = Path(folder) / "runs" / _cached_entry().name
        shutil.copytree(_cached_entry(), entry)
        target = entry / name
        raw = target.read_bytes()
        if name.endswith(".json"):
            raw = data.draw(mutated(raw.decode("utf-8")))
        else:
            for _ in range(data.draw(st.integers(1, 6))):
                at = data.draw(st.integers(0, len(raw) - 1))
                raw = raw[:at] + bytes([data.draw(st.integers(0, 255))]) + raw[at + 1:]
        target.write_bytes(raw)
        if rehash and name != "checksums.json":
            write_checksums(entry)
        said: list[str] = []
        cache = ReferenceCache(Path(folder), None, 60, said.append)  # type: ignore[arg-type]  # reads only
        got = cache._read(entry, "reference")
        assert (got is not None) or (said and not entry.exists()), said


@pytest.mark.parametrize("provides", [["generation", "orkloads"], 5, [{"a": 1}]])
def test_a_cache_entry_with_unreadable_capabilities_is_launched_again(provides: Any) -> None:
    """The manifest's backend capabilities name an unknown capability (a character lost: Hypothesis's find), are not
    a list, or hold an unhashable item, with checksums recomputed to match: the entry is reported and removed (the
    run launches it again), never an exception out of the cache."""
    from harness.flow.refcache import ReferenceCache, write_checksums

    with tempfile.TemporaryDirectory() as folder:
        entry = Path(folder) / "runs" / _cached_entry().name
        shutil.copytree(_cached_entry(), entry)
        manifest = json.loads((entry / "manifest.json").read_text())
        manifest["backend"]["capabilities"]["provides"] = provides
        (entry / "manifest.json").write_text(json.dumps(manifest))
        write_checksums(entry)
        said: list[str] = []
        assert ReferenceCache(Path(folder), None, 60, said.append)._read(entry, "reference") is None  # type: ignore[arg-type]
        assert not entry.exists() and "backend capabilities unreadable" in said[-1], said


VLLM_ANSWER = {"choices": [{"index": 0, "prompt_logprobs": [
    None, {"11": {"logprob": -6.0, "rank": 7}, "5": {"logprob": -0.2, "rank": 1}},
    {"8": {"logprob": -0.3, "rank": 1}, "12": {"logprob": -0.9, "rank": 2}}],
    "logprobs": {"tokens": ["token_id:8", "token_id:2"], "token_logprobs": [-0.1, -0.2],
                 "top_logprobs": [{"token_id:8": -0.1, "token_id:2": -3.0}, {"token_id:2": -0.2}]}}]}
OPENAI_ANSWER = {"choices": [{"index": 0, "logprobs": {
    "tokens": ["token_id:10", "token_id:11", "token_id:3"], "token_logprobs": [None, -0.5, -0.2],
    "top_logprobs": [None, {"token_id:11": -0.5, "token_id:4": -2.0}, {"token_id:3": -0.2}]}}]}
SGLANG_ANSWER = [{"text": "", "output_ids": [4, 4], "meta_info": {
    "input_token_logprobs": [[None, 10, None], [-0.5, 11, None], [-0.2, 12, None]],
    "input_top_logprobs": [None, [[-0.5, 11, None], [-2.0, 4, None]], [[-0.2, 12, None]]],
    "output_token_logprobs": [[-0.1, 4, None], [-0.2, 4, None]],
    "output_top_logprobs": [[[-0.1, 4, None], [-2.5, 9, None]], [[-0.2, 4, None], [-1.5, 3, None]]]}}]
ANSWERS = {"vllm": VLLM_ANSWER, "openai": OPENAI_ANSWER, "sglang": SGLANG_ANSWER}
JSON_LEAF = (st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
             | st.text(max_size=12) | st.sampled_from(["token_id:3", "token_id:-1", "token_id:x", "NaN", "-Infinity"]))
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def _paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and indexes) into a JSON value."""
    out = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, at + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, at + (i,))
    return out


def _replaced(value: Any, at: tuple[Any, ...], new: Any) -> Any:
    if not at:
        return new
    copy = value.copy()
    copy[at[0]] = _replaced(value[at[0]], at[1:], new)
    return copy


@SMALL
@given(dialect=st.sampled_from(sorted(ANSWERS)), data=st.data())
def test_mutated_server_answers_parse_or_raise_run_error(dialect: str, data: st.DataObject) -> None:
    """A server's answer with one part replaced by any JSON value (the whole answer included): the dialect reads
    it or raises the RunError of a bad answer (the cell's ERROR), never another exception."""
    answer = json.loads(json.dumps(ANSWERS[dialect]))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.sampled_from(_paths(answer)))
        answer = _replaced(answer, at, data.draw(JSON_VALUE))

    def post(path: str, body: dict[str, Any]) -> Any:
        return answer

    client = DIALECTS[dialect](post, "m")
    for ask in (lambda: client.score([[10, 11, 12]], k=2, together=True),
                lambda: client.generate([[1, 2]], n=2, k=2, together=True),
                lambda: client.complete([[1, 2]], 4, [2])):
        try:
            ask()
        except RunError as exc:
            assert str(exc)


# Structurally wrong documents: a valid document with one part (the whole document included) replaced by a value of
# the wrong kind: a null, a list, a mapping, a huge or non-finite number, a negative one, a 300-character name.
WRONG = st.sampled_from([None, [], {}, [1, 2], {"a": 1}, 10 ** 30, 1e308, float("inf"), -1, 0, 0.5, True, "",
                         "x" * 300, "tp2>tp1"])
YAML_READERS = {
    "model": (MODEL_TEXT, lambda p: load_model(str(p)), ModelSpec),
    "suite": (SUITE_TEXT, lambda p: load_suite(str(p)), Suite),
    "engine": (ENGINE_TEXTS[0], lambda p: load_engine(str(p)), EngineSpec),
    "catalog": (CATALOG_TEXT, lambda p: load_catalog((p.parent,)), TopologyCatalog),
}


def _wrong_part(doc: Any, data: st.DataObject) -> Any:
    for _ in range(data.draw(st.integers(1, 2))):
        doc = _replaced(doc, data.draw(st.sampled_from(_paths(doc))), data.draw(WRONG))
    return doc


@FUZZ
@given(reader=st.sampled_from(sorted(YAML_READERS)), data=st.data())
def test_structurally_wrong_yaml_documents_raise_config_error(reader: str, data: st.DataObject) -> None:
    """Every YAML reader (model, suite, engine template, topology catalog) given a document with a part of the
    wrong type: the spec, or one ConfigError that names the bad field; never a TypeError or AttributeError."""
    import yaml

    text, load, kind = YAML_READERS[reader]
    doc = _wrong_part(yaml.safe_load(text), data)
    with tempfile.TemporaryDirectory() as folder:
        path = _file(folder, "fuzz.yaml", yaml.safe_dump(doc).encode())
        try:
            assert isinstance(load(path), kind)
        except ConfigError as exc:
            assert str(exc) and "\n" not in str(exc).strip()


@FEW
@given(data=st.data(), command=st.sampled_from(["report", "history"]))
def test_structurally_wrong_results_files_are_one_error(data: st.DataObject, command: str) -> None:
    """results.json with a part replaced by a value of the wrong type (a cell's `model: null` among them):
    `harness report` and `harness history add` read it or give one error line naming it; never a traceback, and
    never an error blamed on the history database."""
    doc = _wrong_part(json.loads(RESULTS_TEXTS[0]), data)
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        run.mkdir()
        _file(str(run), "results.json", json.dumps(doc).encode())
        argv = {"report": ["report", str(run), "--out", f"{folder}/out"],
                "history": ["history", "add", str(run), "--history", f"{folder}/h.db"]}[command]
        code, err = _cli(argv)
        assert "Traceback" not in err and "internal error" not in err, err
        assert "constraint" not in err, err
        assert code in (0, 1, 2, 3), (code, err)
        if code == 2:
            assert len([line for line in err.splitlines() if line.startswith("harness: error:")]) == 1, err


HUGE = st.sampled_from(["1e300", "inf", "99999999999", "1e18", "604801", "16777217", "-5", "0", "nan"])


@SMALL
@given(option=st.sampled_from(["--timeout", "--collective-timeout", "--max-seq-len", "--kv-budget-mib"]), value=HUGE,
       long_out=st.booleans())
def test_run_numeric_options_are_bounded(option: str, value: str, long_out: bool) -> None:
    """Absurd numbers and over-long output names on `harness run`: one error line and exit 2 (the option, the value
    and the stated maximum), never an overflow or an OSError."""
    with tempfile.TemporaryDirectory() as folder:
        out = f"{folder}/{'o' * 300 if long_out else 'out'}"
        code, err = _cli(["run", "--suite", "dcp", "--out", out, "--cache-dir", f"{folder}/cache",
                          "--engine", "no-such-engine", option, value])
        _one_error_or_ok(code, err)
        assert code == 2, err


SERVE_VALUES = (st.text(max_size=8) | st.sampled_from(["0", "-1", "1e300", "99999999999999", "nan", "x" * 300, ""])
                | st.integers(-10, 1 << 40).map(str))


@FEW
@given(options=st.lists(st.tuples(st.sampled_from(["--model", "--topo", "--kv-budget-mib", "--max-seq-len",
                                                   "--max-logprobs", "--spec-k", "--dtype", "--pd-store", "--pd-role",
                                                   "--attention-backend", "--fault", "--served-model-name"]),
                                  SERVE_VALUES), max_size=3),
       store=st.sampled_from(["none", "file", "missing", "dir"]))
def test_serve_command_lines_are_one_error(options: list[tuple[str, str]], store: str) -> None:
    """`harness serve` with fuzzed options (wrong types, huge numbers, long names) and a --pd-store that is a file,
    a folder under a missing one or a folder: exit 2 with one `harness: error:` line, never a traceback. The port
    is held by this test, so a command line that passes every check ends at `cannot listen` (exit 2) and nothing
    ever starts."""
    with tempfile.TemporaryDirectory() as folder, socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        argv = ["serve", "--model", "tiny-gqa", "--topo", "tp2>tp1", "--pd-role", "decode",
                "--port", str(held.getsockname()[1])]
        if store != "none":
            path = Path(folder) / ("missing/store" if store == "missing" else "store")
            if store == "file":
                path.write_text("not a folder")
            elif store == "dir":
                path.mkdir()
            argv += ["--pd-store", str(path)]
        argv += [x for option in options for x in option]
        code, err = _cli(argv)
        _one_error_or_ok(code, err)
        assert code == 2, err
