"""`harness plan` and `harness list`, in process and through a real `python -m harness` process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main
from harness.partition.layout import LAYOUT_SCHEMA_VERSION
from harness.specs.model import shipped_models
from harness.specs.suite import shipped_suites

GIB = 1024 ** 3
RANK_KEYS = {"rank", "q_heads", "kv_heads", "dcp_group", "kv_tp_rank", "q_to_kv"}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    rc, out, err = run_cli(capsys, "plan", *argv, "--format", "json")
    assert rc == 0, err
    assert err == ""
    return json.loads(out)


def table_rows(out: str) -> list[list[str]]:
    """The per-rank rows of the plan table: the lines between the dashes and the totals."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("----")) + 1
    rows = []
    for line in lines[start:]:
        if not line[:1].isdigit():
            break
        rows.append(line.split())
    return rows


def test_plan_table_kv6_tp4(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "plan", "--model", "tiny-kv6", "--topo", "tp4")
    assert rc == 0 and err == ""
    assert out.splitlines()[0] == "model tiny-kv6 on tp4 (tp=4, dcp=1, kv_tp_size=4, gcd=2)"
    assert out.splitlines()[1].split() == ["rank", "q_heads", "kv_heads", "dcp_group", "dcp_rank", "kv_tp_rank",
                                           "reads_kv", "vocab", "ffn"]
    assert table_rows(out) == [  # vocab 384, ffn 288 over tp4
        ["0", "0-5", "0-2", "0", "0", "0", "0-1", "0-95", "0-71"],
        ["1", "6-11", "0-2", "1", "0", "1", "1-2", "96-191", "72-143"],
        ["2", "12-17", "3-5", "2", "0", "2", "3-4", "192-287", "144-215"],
        ["3", "18-23", "3-5", "3", "0", "3", "4-5", "288-383", "216-287"],
    ]
    # 2 (K, V) x 2 layers x 3 KV heads x head_dim 8 x 4 bytes
    assert "KV bytes/token per rank (stored token): 384 " in out
    assert "KV duplication: x2 (ranks holding each KV head: [2, 2, 2, 2, 2, 2])" in out
    assert "capacity" not in out and "speculator" not in out


def test_plan_table_dcp_capacity_and_speculator(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "plan", "--model", "tiny-gqa", "--topo", "tp4dcp4-mtp", "--budget-gib", "0.01",
                         "--max-seq-len", "256")
    assert rc == 0
    assert [row[:7] for row in table_rows(out)] == [
        [str(r), f"{2 * r}-{2 * r + 1}", "0-1", "0", str(r), "0", "0"] for r in range(2)] + [
        [str(r), f"{2 * r}-{2 * r + 1}", "0-1", "0", str(r), "0", "1"] for r in range(2, 4)]
    assert [row[7:] for row in table_rows(out)] == [[f"{96 * r}-{96 * r + 95}", f"{72 * r}-{72 * r + 71}"]
                                                    for r in range(4)]
    # per rank: 2 KV heads x 16 dims x 2 layers x K,V x 4 bytes = 512 bytes/token; a 256-token slot split
    # over dcp=4 is 64 tokens = 4 blocks of 16 = 32768 bytes; int(0.01 GiB) // 32768 = 327 slots.
    assert "capacity per rank: 327 slots of 256 tokens = 1308 blocks x 16 tokens" in out
    # The MTP module keeps the TP layout: one KV head per rank, one layer.
    assert ("speculator (mtp, plain TP layout, dcp=1): KV heads per rank r0:0, r1:0, r2:1, r3:1; "
            "256 bytes/token per rank") in out


def test_plan_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys, "--model", "tiny-kv6", "--topo", "tp4")
    assert doc["schema_version"] == LAYOUT_SCHEMA_VERSION == 3
    assert doc["model"] == "tiny-kv6"
    assert doc["topology"] == {"name": "tp4", "tp": 4, "dcp": 1, "speculator": "none", "world_size": 4}
    assert (doc["tp"], doc["dcp"], doc["kv_tp_size"], doc["kv_gcd"]) == (4, 1, 4, 2)
    assert doc["kv_bytes_per_token_per_rank"] == 384
    assert doc["kv_bytes_per_token_per_dcp_group"] == 384
    assert doc["kv_bytes_per_token_total"] == 4 * 384
    assert doc["kv_duplication"] == 2
    assert doc["kv_replicas"] == [2] * 6
    assert doc["capacity"] is None and doc["speculator"] is None and doc["hybrid"] is None
    assert len(doc["ranks"]) == 4
    for r, rank in enumerate(doc["ranks"]):
        assert RANK_KEYS <= set(rank)
        assert rank["rank"] == r
        assert rank["q_heads"] == list(range(6 * r, 6 * r + 6))
        assert rank["kv_heads"] == ([0, 1, 2] if r < 2 else [3, 4, 5])
        assert rank["q_to_kv"] == [q // 4 for q in rank["q_heads"]]
        assert set(rank["q_to_kv"]) <= set(rank["kv_heads"])
        assert (rank["dcp_group"], rank["dcp_rank"], rank["dcp_members"], rank["kv_tp_rank"]) == (r, 0, [r], r)
        assert rank["group_q_heads"] == rank["q_heads"]
        assert rank["ffn_shard"] == [72 * r, 72 * r + 72]
        assert (rank["vocab_shard"], rank["vocab_rows"]) == ([96 * r, 96 * r + 96], 96)
    assert doc["vocab_rows_per_rank"] == 96
    # an uneven vocabulary: 389 over tp4 is 98, 98, 98, 95 ids, every shard padded to 98 rows
    uneven = plan_json(capsys, "--model", "tiny-bf16-big", "--topo", "tp4")
    assert [r["vocab_shard"] for r in uneven["ranks"]] == [[0, 98], [98, 196], [196, 294], [294, 389]]
    assert uneven["vocab_rows_per_rank"] == 98


def test_plan_json_dcp_group_and_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys, "--model", "tiny-gqa", "--topo", "tp4dcp4-draft", "--budget-gib", "0.01",
                    "--max-seq-len", "256", "--block-size", "32")
    assert doc["topology"]["speculator"] == "draft" and doc["kv_duplication"] == 1
    for rank in doc["ranks"]:
        assert rank["kv_heads"] == [0, 1] and rank["dcp_group"] == 0 and rank["kv_tp_rank"] == 0
        assert rank["dcp_members"] == [0, 1, 2, 3] and rank["group_q_heads"] == list(range(8))
    assert doc["capacity"] == {
        "max_seq_len": 256, "budget_bytes": int(0.01 * GIB), "block_size": 32, "blocks_per_slot": 2,
        "slots": int(0.01 * GIB) // (2 * 32 * 512), "blocks": 2 * (int(0.01 * GIB) // (2 * 32 * 512)),
        "block_bytes": 32 * 512, "pool_bytes": 2 * (int(0.01 * GIB) // (2 * 32 * 512)) * 32 * 512,
        "tokens_per_rank": 2 * (int(0.01 * GIB) // (2 * 32 * 512)) * 32}
    spec = doc["speculator"]
    assert spec["kind"] == "draft" and spec["dcp"] == 1 and spec["kv_duplication"] == 2
    assert [r["kv_heads"] for r in spec["ranks"]] == [[0], [0], [1], [1]]
    assert spec["kv_bytes_per_token_per_rank"] == 2 * 2 * 1 * 16 * 4  # tiny-gqa: speculator_layers=2


@pytest.mark.parametrize("argv,message", [
    (["--model", "tiny-9h3kv", "--topo", "tp4"], "heads=9 is not divisible by tp=4"),
    (["--model", "tiny-gqa", "--topo", "tp4dcp3"], "dcp=3 does not divide tp=4"),
    (["--model", "tiny-gqa", "--topo", "tp4dpc2"], "unknown topology or set 'tp4dpc2'; expected tp<N>"),
    (["--model", "tiny-gqa", "--topo", "tp4-drfat"], "(did you mean 'draft'?)"),
    (["--model", "tiny-gqa", "--topo", "dcp-nightly"], "names 7 topologies; plan takes exactly one"),
    (["--model", "tiny-gq", "--topo", "tp2"], "unknown model 'tiny-gq' (did you mean 'tiny-gqa'?)"),
    (["--model", "tiny-gqa", "--topo", "tp4dcp4", "--budget-gib", "0.0001"],
     f"short by {32 * 16 * 512 - int(0.0001 * GIB)} bytes"),
])
def test_plan_invalid_input_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                   message: str) -> None:
    for fmt in ("table", "json"):
        rc, out, err = run_cli(capsys, "plan", *argv, "--format", fmt)
        assert rc == 2
        assert out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1
        assert lines[0].startswith("harness: error: ") and message in lines[0]


def test_plan_budget_error_names_the_shortfall(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "plan", "--model", "tiny-gqa", "--topo", "tp4dcp4", "--budget-gib", "0.0001")
    assert rc == 2
    budget = int(0.0001 * GIB)
    assert err.strip() == (
        f"harness: error: KV budget of {budget} bytes per rank cannot hold one sequence slot of 262144 bytes "
        f"(32 blocks x 16 tokens x 512 bytes/token, max_seq_len=2048, dcp=4): short by {262144 - budget} bytes")


def test_plan_hybrid_model_shows_linear_state_experts_and_cache_groups(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "plan", "--model", "tiny-hybrid", "--topo", "tp4dcp2ep4-mtp", "--budget-gib",
                           "0.001", "--max-seq-len", "256")
    assert rc == 0, err
    assert "layers: LLLFLLLF (6 linear attention, 2 full attention with output gate)" in out
    lines = out.splitlines()
    lin = lines.index(next(line for line in lines if line.startswith("linear attention (V heads")))
    # tiny-hybrid: 6 V heads, 2 K heads of 16 dims over kv_tp_size 2; a DCP group holds the same heads
    assert [line.split() for line in lines[lin + 3:lin + 7]] == [
        ["0", "0-2", "0", "0-2", "0-15", "32-47", "64-111", "960", "B", "3.00", "KiB"],
        ["1", "0-2", "0", "-", "0-15", "32-47", "64-111", "960", "B", "3.00", "KiB"],
        ["2", "3-5", "1", "3-5", "16-31", "48-63", "112-159", "960", "B", "3.00", "KiB"],
        ["3", "3-5", "1", "-", "16-31", "48-63", "112-159", "960", "B", "3.00", "KiB"]]
    moe = lines.index(next(line for line in lines if line.startswith("MoE: 8 experts, top-2, ep=4")))
    assert [line.split()[4] for line in lines[moe + 3:moe + 7]] == ["0-1", "2-3", "4-5", "6-7"]
    # one slot: attention 8 pages x 4 KiB (2 full layers), recurrent 1 x 6 layers x (960 + 3072) bytes,
    # MTP 16 pages x 2 KiB: 32768 + 24192 + 32768 = 89728 bytes; int(0.001 GiB) // 89728 = 11 slots
    assert ("cache groups per rank (one slot = one sequence of 256 tokens, 16-token pages): attention 8 x 4.00 KiB; "
            "recurrent 1 x 23.62 KiB; mtp 16 x 2.00 KiB") in out
    assert "grouped capacity per rank: 11 slots" in out
    assert "attention 88 blocks, recurrent 11 blocks, mtp 176 blocks" in out
    doc = plan_json(capsys, "--model", "tiny-hybrid", "--topo", "tp4ep2", "--budget-gib", "0.001")
    hyb = doc["hybrid"]
    assert doc["topology"]["ep"] == 2 and hyb["moe"]["etp"] == 2
    assert [r["experts"] for r in hyb["moe"]["ranks"]] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2
    assert [g["name"] for g in hyb["capacity"]["groups"]] == ["attention", "recurrent"]
    assert doc["capacity"] is None and doc["kv_bytes_per_token_per_rank"] == 2 * 2 * 1 * 16 * 4


def test_plan_hybrid_errors(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "plan", "--model", "tiny-gqa", "--topo", "tp4ep2")
    assert rc == 2 and "ep=2 needs a MoE model; tiny-gqa is dense" in err
    rc, _, err = run_cli(capsys, "plan", "--model", "tiny-hybrid", "--topo", "tp4dcp2c")
    assert rc == 2 and "tiny-hybrid is a hybrid model" in err and "got placement contiguous" in err
    rc, _, err = run_cli(capsys, "plan", "--model", "tiny-hybrid", "--topo", "tp4", "--budget-gib", "0.00001",
                         "--max-seq-len", "256")
    assert rc == 2 and "across 2 cache groups" in err
    assert "attention: 16 blocks x 4096 bytes" in err and "recurrent: 1 blocks" in err


def test_plan_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["plan", "--topo", "tp4"], ["plan", "--model", "tiny-gqa", "--topo", "tp4", "--format", "xml"],
                 ["nosuchcommand"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert "harness: error:" in capsys.readouterr().err


@pytest.mark.parametrize("what", ["suites", "topologies", "models"])
def test_list_sections(capsys: pytest.CaptureFixture[str], what: str) -> None:
    rc, out, err = run_cli(capsys, "list", what)
    assert rc == 0 and err == ""
    first_words = [line.split()[0] for line in out.splitlines() if line and not line.startswith("(")]
    if what == "suites":
        assert first_words == list(shipped_suites())
        assert {"dcp", "tp", "gqa-odd"} <= set(first_words)
    elif what == "models":
        assert first_words == list(shipped_models())
        rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
        assert rows["tiny-kv6"][:2] == ["heads=24", "kv=6"]
        assert rows["tiny-9h3kv"][:2] == ["heads=9", "kv=3"]
    else:
        assert "dcp-nightly" in first_words
        line = next(line for line in out.splitlines() if line.split()[0] == "dcp-nightly")
        assert line.split(None, 1)[1] == "set: tp4dcp2, tp4dcp4, tp8dcp2, tp8dcp4, tp4dcp2i4, tp4dcp2c, tp8dcp8"
        assert "tp<N>[dcp<M>[i<K>|c][q]][dp<D>][ep<E>][-draft|-mtp]" in out


def test_list_all(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "list")
    assert rc == 0
    headers = [line for line in out.splitlines() if line.startswith("# ")]
    assert headers == ["# suites", "# topologies", "# models", "# faults", "# engines", "# checks", "# workloads"]


def run_process(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness", *argv], capture_output=True, text=True, cwd=cwd,
                          timeout=120, check=False)


def test_python_m_harness_plan(tmp_path: Path) -> None:
    """A real process, started outside the repository: shipped specs are found from the package."""
    proc = run_process("plan", "--model", "tiny-gqa", "--topo", "tp4dcp4", "--format", "json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema_version"] == LAYOUT_SCHEMA_VERSION and doc["kv_duplication"] == 1
    assert [r["kv_heads"] for r in doc["ranks"]] == [[0, 1]] * 4
    assert [r["q_to_kv"] for r in doc["ranks"]] == [[0, 0], [0, 0], [1, 1], [1, 1]]

    proc = run_process("plan", "--model", "tiny-9h3kv", "--topo", "tp4", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["harness: error: heads=9 is not divisible by tp=4"]

    proc = run_process("plan", "--model", "tiny-9h3kv", "--topo", "tp3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert table_rows(proc.stdout) == [["0", "0-2", "0", "0", "0", "0", "0", "0-127", "0-95"],
                                       ["1", "3-5", "1", "1", "0", "1", "1", "128-255", "96-191"],
                                       ["2", "6-8", "2", "2", "0", "2", "2", "256-383", "192-287"]]


def test_plan_and_report_do_not_import_torch(tmp_path: Path) -> None:
    """`harness plan` and `harness report` only read specs and JSON: they start in a fraction of a second
    because nothing on their path imports torch (about 3 s on a small machine)."""
    results = Path(__file__).parent / "data" / "results" / "clean"
    script = ("import sys, contextlib, io\nfrom harness.cli import main\n"
              "with contextlib.redirect_stdout(io.StringIO()):\n"
              "    assert main(['plan', '--model', 'tiny-gqa', '--topo', 'tp4dcp4']) == 0\n"
              f"    assert main(['report', {str(results)!r}, '--out', {str(tmp_path / 'report')!r}]) == 0\n"
              "assert 'torch' not in sys.modules, 'torch imported'\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
