"""An HTTP engine is its template file: every engines/*.yaml is a backend named by its stem (no line of
Python per engine), listed by `harness list engines` with its description, and a template that is not
shipped runs by its path (`--engine PATH.yaml[:OPTION]`); a missing one is one error naming the path."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from harness.backends.http.backend import HttpBackend
from harness.backends.registry import BUILTIN, HTTP_BACKEND, available, get_backend
from harness.cli import main
from harness.core.errors import ConfigError
from harness.core.jsonio import read_json
from harness.records.results import results_cells
from harness.specs.engine import ENGINES_DIR, load_engine

DESCRIPTION = "my engine: harness serve under another name"


def _my_engine(folder: Path, source: str = "harness-serve") -> Path:
    """engines/SOURCE.yaml copied as FOLDER/my-engine.yaml, only its description changed."""
    data = yaml.safe_load((ENGINES_DIR / f"{source}.yaml").read_text())
    data["description"] = DESCRIPTION
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "my-engine.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_the_shipped_engines_are_the_files_in_engines() -> None:
    files = {p.stem for p in ENGINES_DIR.glob("*.yaml")}
    templates = {name: info for name, info in available().items() if info.template}
    assert set(templates) == files and {"harness-serve", "vllm", "sglang", "openai"} <= files
    assert not files & set(BUILTIN)  # a template never hides behind a built-in of the same name
    for name, info in templates.items():
        assert info.target == HTTP_BACKEND and info.origin == f"engines/{name}.yaml"
        assert Path(info.template) == ENGINES_DIR / f"{name}.yaml"


def test_a_new_file_in_an_engines_folder_is_an_engine(tmp_path: Path) -> None:
    folder = tmp_path / "engines"
    _my_engine(folder)
    info = available(folder)["my-engine"]
    assert info.origin == "engines/my-engine.yaml" and info.target == HTTP_BACKEND
    backend = get_backend("my-engine", folder)
    assert isinstance(backend, HttpBackend) and backend.name == "my-engine"
    assert backend.spec.description == DESCRIPTION
    assert "harness-serve" not in available(folder) and {"embedded", "replay"} <= set(available(folder))


def test_harness_list_engines_shows_every_template_with_its_description(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "engines"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for path in sorted(ENGINES_DIR.glob("*.yaml")):
        line = next(x for x in lines if x.split()[0] == path.stem)
        assert f"[engines/{path.name}]" in line and load_engine(path.stem).description in line


def test_a_template_that_is_not_shipped_runs_by_its_path(tmp_path: Path) -> None:
    path = _my_engine(tmp_path)
    backend = get_backend(str(path))
    assert isinstance(backend, HttpBackend) and backend.name == "my-engine"
    assert backend.spec.description == DESCRIPTION
    with pytest.raises(ConfigError, match="'my-engine' starts its own server and takes no option"):
        get_backend(f"{path}:http://127.0.0.1:9")
    attach = get_backend(f"{_my_engine(tmp_path / 'attach', 'openai')}:http://127.0.0.1:9/")
    assert isinstance(attach, HttpBackend) and attach.spec.url == "http://127.0.0.1:9"  # OPTION keeps its meaning
    with pytest.raises(ConfigError, match=f"engine template {tmp_path / 'missing.yml'} does not exist"):
        get_backend(str(tmp_path / "missing.yml"))


def test_a_missing_template_is_one_error_naming_its_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--engine", "--reference-engine"):
        code = main(["run", "--suite", "tp", "--model", "tiny-gqa", "--topo", "tp2", flag, "/nonexistent.yaml",
                     "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")])
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("harness: error:")]
        assert code == 2 and len(err) == 1 and "/nonexistent.yaml does not exist" in err[0], err
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_a_cell_runs_through_a_template_given_by_its_path(tmp_path: Path) -> None:
    path = _my_engine(tmp_path / "templates")
    out = tmp_path / "out"
    code = main(["run", "--suite", "tp", "--model", "tiny-gqa", "--topo", "tp2", "--engine", str(path),
                 "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--kv-budget-mib", "8",
                 "--max-seq-len", "128", "--workload", "prompts"])
    cell = results_cells(out)[0]
    assert code == 0 and cell["status"] == "PASS" and cell["engine"] == "my-engine", cell["status"]
    manifest = read_json(Path(cell["run_dir"]) / "manifest.json")
    assert manifest["backend"]["name"] == "my-engine"
    assert f"--engine {path.resolve()}" in cell["command"]  # the cell's command re-runs it from any folder
