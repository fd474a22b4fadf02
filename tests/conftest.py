"""Test setup: no hub access, ever; GSM8K from the full data set when given, else the fixture in
tests/data/gsm8k (32 questions per split), so the test command passes in any clone."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every launch a test starts (in-process `harness run`, subprocesses, launch_run) is bounded by this
# many seconds, and pytest's per-test timeout (pyproject.toml) allows TEST_LAUNCHES_PER_TEST of them:
# a hung rank shows up as the harness's ERROR cell with its log tail, never as pytest killing a test
# that was only slow on a loaded machine.
TEST_LAUNCH_TIMEOUT_S = 900.0  # the harness's own default: at load ~15 on 2 cores a SmolLM2 reference took > 420 s
TEST_LAUNCHES_PER_TEST = 4
os.environ.setdefault("HARNESS_LAUNCH_TIMEOUT_S", str(TEST_LAUNCH_TIMEOUT_S))
# Under pytest-xdist every worker's launches share the machine's cores: one intra-op thread per rank, so
# two workers' launches never oversubscribe them (each launch would otherwise assume it owns every core).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("HARNESS_THREADS_PER_PROCESS", "1")

GSM8K_FIXTURE = Path(__file__).resolve().parent / "data" / "gsm8k"
GSM8K_FULL_TEST_QUESTIONS = 1319
_SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
if not os.environ.get("HARNESS_GSM8K_PATH"):
    os.environ["HARNESS_GSM8K_PATH"] = str(_SHARED_GSM8K if (_SHARED_GSM8K / "test.jsonl").is_file()
                                           else GSM8K_FIXTURE)


def gsm8k_lines(split: str) -> int:
    """Questions in `split` of the GSM8K folder the tests use (the fixture or the full set)."""
    with open(Path(os.environ["HARNESS_GSM8K_PATH"]) / f"{split}.jsonl", encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


import pytest  # noqa: E402

from harness.records.artifacts import RunArtifacts, read_run  # noqa: E402

try:
    from _pytest.nodes import NodeId  # noqa: E402  (pytest >= 9)
except ImportError:  # pytest < 9 reads item._nodeid, which pytest-xdist sets
    NodeId = None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup` pytest-xdist (3.8) suffixes the id of an item marked xdist_group("G") with "@G" by
    setting `item._nodeid`, which pytest 9 no longer reads (a node's id is `item._id`): every group was spread over
    both workers, and a worker needing a group's module fixture waited on the other's lock (up to 300 s per vLLM
    run). The suffixed id is carried into `item._id`, so a group's tests run on one worker again."""
    for item in items:
        suffixed = getattr(item, "_nodeid", None)
        if isinstance(suffixed, str) and "@" in suffixed and suffixed != item.nodeid and NodeId is not None:
            item._id = NodeId.parse(suffixed)


TEST_PROMPTS = ["The capital of France is", "def f(x):\n    return", "Q: 17 + 25 = ?\nA:"]


def launch_run(out_dir: Path, model: str, topo: str, fault: str | None = None, prompts: list[str] | None = None,
               dtype: str | None = None, env: dict[str, str] | None = None, timeout_s: float = TEST_LAUNCH_TIMEOUT_S,
               collective_timeout_s: float = 60.0) -> RunArtifacts:
    """Launch one real run (torchrun on gloo for world size > 1) and read its run directory."""
    from harness.backends.embedded.backend import WORKER_MODULE
    from harness.formats.locate import load_model
    from harness.launcher.launch import launch
    from harness.records.contract import Job
    from harness.specs.pool import PoolSettings
    from harness.specs.topology import parse_topology_name

    topology = parse_topology_name(topo)
    job = Job(model=load_model(model), topology=topology, prompts=prompts or TEST_PROMPTS,
              out_dir=str(out_dir), fault=fault, dtype=dtype, max_new_tokens=12, decode_prefix_tokens=3,
              pool=PoolSettings(budget_bytes=8 << 20, max_seq_len=256), collective_timeout_s=collective_timeout_s)
    launch(job, timeout_s, WORKER_MODULE, env=env)
    return read_run(out_dir)


def small_gsm8k_suite(folder: Path, suite: dict[str, object], gsm8k: dict[str, object]) -> Path:
    """The shipped gsm8k suite with `suite` and `gsm8k` settings overridden, written to folder/gsm8k.yaml
    (the suite keeps its name: gsm8k)."""
    import yaml

    from harness.core.paths import SUITES_DIR

    doc = yaml.safe_load((SUITES_DIR / "gsm8k.yaml").read_text())
    doc.update(suite)
    doc["gsm8k"].update(gsm8k)
    path = folder / "gsm8k.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="session")
def full_gsm8k() -> Path:
    """The full GSM8K folder; skips when the tests run on the fixture only."""
    if gsm8k_lines("test") < GSM8K_FULL_TEST_QUESTIONS:
        pytest.skip("needs the full GSM8K set: set HARNESS_GSM8K_PATH to a folder with test.jsonl/train.jsonl "
                    f"(only the {gsm8k_lines('test')}-question fixture in tests/data/gsm8k is here)")
    return Path(os.environ["HARNESS_GSM8K_PATH"])


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One reference cache for every test that only reads what it gets from it: entries are keyed by
    content and written under a private name then renamed (harness/flow/refcache.py), so xdist workers share
    it safely and a reference the shipped dcp suite needs is launched once per session, not per test."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # shared by the workers of a session
    path = root / "shared-reference-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str | None], RunArtifacts]:
    return {}


@pytest.fixture
def run(tmp_path_factory: pytest.TempPathFactory, run_cache: dict) -> object:  # type: ignore[type-arg]
    """run(model, topo, fault=None) -> RunArtifacts, launched once per test session (and xdist worker)."""
    def _run(model: str, topo: str, fault: str | None = None) -> RunArtifacts:
        key = (model, topo, fault)
        if key not in run_cache:
            run_cache[key] = launch_run(tmp_path_factory.mktemp(f"{model}-{topo}-{fault}"), model, topo, fault)
        return run_cache[key]
    return _run


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's size=, e.g. 1600k) mounted at `mnt` (a small disk to fill, or to remount
    read-only): needs root and mount, the test is skipped otherwise; unmounted after (lazily when a file in it is
    still open)."""
    mnt.mkdir(exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], check=False).returncode:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
