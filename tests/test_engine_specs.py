"""Engine templates (engines/*.yaml): every shipped one loads; mistakes are one error naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.core.errors import ConfigError
from harness.specs.engine import engine_from_dict, load_engine, shipped_engines

GOOD = {"dialect": "vllm", "argv": ["{python}", "-m", "server", "--tp", "{tp}", "--dcp", "{dcp}", "--port", "{port}"]}


def test_every_shipped_template_loads() -> None:
    names = set(shipped_engines())
    assert {"vllm", "sglang", "openai", "harness-serve"} <= names
    for name in names:
        spec = load_engine(name)
        assert spec.name == name and (spec.argv or spec.url)
    assert load_engine("vllm").dcp_argv == ("--decode-context-parallel-size", "{dcp}")
    assert load_engine("sglang").dcp_argv == ("--dcp-size", "{dcp}")


@pytest.mark.parametrize("change, message", [
    ({"dialet": "vllm"}, "unknown key 'dialet'.*did you mean 'dialect'"),
    ({"dialect": "vlm"}, "dialect='vlm'.*did you mean 'vllm'"),
    ({"argv": ["{python}", "--tp", "{tpp}", "{dcp}"]}, r"unknown placeholder \{tpp\}.*did you mean 'tp'"),
    ({"url": "http://127.0.0.1:1"}, "either argv .* or url"),
    ({"argv": ["{python}", "--tp", "{tp}"]}, "supports_dcp is true but neither argv nor dcp_argv"),
    ({"speculator_argv": {"eagle": ["--x"]}}, "unknown kind 'eagle'"),
    ({"kv_capacity_pattern": "KV (\\d+)"}, "needs a named group"),
    ({"health": "health"}, "must be a path starting with '/'"),
    ({"refuses": ["DCP (not"]}, "refuses pattern 'DCP \\(not' is not a regular expression"),
    ({"refuses": "DCP"}, "refuses must be a list, got .DCP."),
    ({"refuse": ["DCP"]}, "unknown key 'refuse'.*did you mean 'refuses'"),
])
def test_bad_templates_are_one_clear_error(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        engine_from_dict("t.yaml", {**GOOD, **change}, "t")


def test_unknown_engine_names_the_shipped_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown engine template 'vlm'.*did you mean 'vllm'"):
        load_engine("vlm")
    path = tmp_path / "mine.yaml"
    path.write_text("dialect: sglang\nargv: ['{python}', '{topology}']\n")
    assert load_engine(str(path)).name == "mine"


def test_python_comes_from_the_override_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HARNESS_VLLM_PYTHON", raising=False)
    spec = load_engine("vllm")
    assert spec.python_env_var() == "HARNESS_VLLM_PYTHON"
    assert spec.interpreter().endswith(".venv-vllm/bin/python")
    monkeypatch.setenv("HARNESS_VLLM_PYTHON", str(tmp_path / "py"))
    assert spec.interpreter() == str(tmp_path / "py")
