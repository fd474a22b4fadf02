"""An engine build whose version string does not change (a team's fork, a local checkout) is told apart by its
build label (`--engine-build LABEL`, or what the template's `build_argv` prints): it keys the reference cache,
is recorded in the cell, the manifests and the provenance, shown in the report and repeated by the reproduce
command."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from harness.backends.base import backend_record
from harness.backends.build import check_label, with_build
from harness.backends.http.backend import HttpBackend
from harness.cli import main
from harness.core.errors import ConfigError
from harness.core.jsonio import read_json
from harness.formats.locate import load_model
from harness.records.contract import Job
from harness.records.results import results_cells
from harness.specs.topology import parse_topology_name

ROOT = Path(__file__).resolve().parents[1]


def _template(tmp_path: Path, **extra: object) -> Path:
    template = yaml.safe_load((ROOT / "engines" / "harness-serve.yaml").read_text())
    template.update(extra)
    path = tmp_path / "serve-build.yaml"
    path.write_text(yaml.safe_dump(template))
    return path


def _job(tmp_path: Path) -> Job:
    return Job(model=load_model("tiny-gqa"), topology=parse_topology_name("tp1"), prompts=["hi"],
               out_dir=str(tmp_path / "run"))


def test_a_template_build_command_names_the_build_and_keys_it(tmp_path: Path) -> None:
    plain = HttpBackend(str(_template(tmp_path)))
    built = HttpBackend(str(_template(tmp_path, build_argv=["{python}", "-c", "print('fork-1234'); print('x')"])))
    assert plain.engine_build() == "" and built.engine_build() == "fork-1234"
    assert built.identity(_job(tmp_path))["engine_build"] == "fork-1234"
    assert backend_record(built)["build"] == "fork-1234" and "build" not in backend_record(plain)
    # the label on the command line wins over the template's, and keys another build
    labelled = with_build(built, "team-7")
    assert labelled.engine_build() == "team-7" and labelled.identity(_job(tmp_path)) != built.identity(_job(tmp_path))


def test_bad_build_labels_and_commands_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--engine-build='a\\nb' is not a build label"):
        check_label("a\nb")
    with pytest.raises(ConfigError, match=r"build_argv may use only the \{python\} placeholder, not \{port\}"):
        HttpBackend(str(_template(tmp_path, build_argv=["echo", "{port}"])))
    failing = HttpBackend(str(_template(tmp_path, build_argv=[sys.executable, "-c", "raise SystemExit(3)"])))
    with pytest.raises(ConfigError, match=r"build_argv .* failed"):
        failing.engine_build()


@pytest.mark.slow
def test_engine_build_is_recorded_keyed_shown_and_reproduced(tmp_path: Path) -> None:
    path, cache = _template(tmp_path), tmp_path / "cache"

    def run(out: str, *extra: str) -> dict:
        assert main(["run", "--suite", "tp", "--model", "tiny-gqa", "--topo", "tp2", "--engine", str(path), "--out",
                     str(tmp_path / out), "--cache-dir", str(cache), "--kv-budget-mib", "8", "--max-seq-len", "128",
                     "--workload", "prompts", *extra]) == 0
        return results_cells(tmp_path / out)[0]

    plain = run("plain")
    cell = run("built", "--engine-build", "vllm-fork@4f2a9c1")
    assert plain["engine_build"] == "" and cell["engine_build"] == "vllm-fork@4f2a9c1"
    assert "--engine-build vllm-fork@4f2a9c1" in cell["command"] and "--engine-build" not in plain["command"]
    assert cell["reference_dir"] != plain["reference_dir"]  # the build keys the reference cache
    for run_dir in (cell["run_dir"], cell["reference_dir"]):
        assert read_json(Path(run_dir) / "manifest.json")["backend"]["build"] == "vllm-fork@4f2a9c1"
    assert read_json(tmp_path / "built" / "results.json")["provenance"]["engine_build"] == "vllm-fork@4f2a9c1"
    assert "build vllm-fork@4f2a9c1" in (tmp_path / "built" / "summary.md").read_text()
    assert "build vllm-fork@4f2a9c1" in (tmp_path / "built" / "index.html").read_text()
