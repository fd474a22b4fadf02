"""`harness serve` at tp2dcp2: both dialects answer with the embedded engine's numbers (tp1, in
process), agree with each other by token id, refuse bad requests with 400, and SIGTERM stops every rank."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from harness.backends.http.dialects import SglangDialect, VllmDialect, post_json, sampling_fields
from harness.backends.http.server import Server, free_port, running_server, wait_ready
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.sampler import Sampler
from harness.engine.runtime.scheduler import generate
from harness.formats.locate import load_model
from harness.formats.weights import load_weights
from harness.launcher.launch import THREADS_ENV, available_cores, threads_per_process
from harness.specs.sampling import SamplingParams

SEQUENCES = [[72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100], [81, 58, 32, 49, 55]]
K = 5


@contextmanager
def serving(folder: Path, topo: str, max_seq_len: int, kv_budget_mib: int) -> Iterator[Server]:
    """A real `harness serve` of tiny-gqa on a free loopback port, ready, its log in `folder`."""
    port = free_port()
    argv = [sys.executable, "-m", "harness", "serve", "--model", "tiny-gqa", "--topo", topo,
            "--port", str(port), "--max-seq-len", str(max_seq_len), "--kv-budget-mib", str(kv_budget_mib)]
    with running_server(argv, {}, folder / "server.log", f"http://127.0.0.1:{port}") as srv:
        wait_ready(srv, "/health", 300)
        yield srv


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("serve"), "tp2dcp2", 128, 8) as srv:
        yield srv
    assert srv.proc is not None and srv.proc.poll() is not None  # stopped with the block


@pytest.fixture(scope="module")
def reference() -> Engine:
    spec = load_model("tiny-gqa")
    return Engine(spec, load_weights(spec), ParallelState.single())


def test_both_dialects_match_the_embedded_engine(server: Server, reference: Engine) -> None:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        post = post_json(client)
        vllm = VllmDialect(post, "tiny-gqa").score(SEQUENCES, K, together=True)
        sglang = SglangDialect(post, "tiny-gqa").score(SEQUENCES, K, together=False)
        gen_v = VllmDialect(post, "tiny-gqa").generate(SEQUENCES, 6, K, together=True)
        gen_s = SglangDialect(post, "tiny-gqa").generate(SEQUENCES, 6, K, together=False)
    for seq, v, s in zip(SEQUENCES, vllm, sglang):
        logprobs = torch.log_softmax(reference.prefill_logits([seq])[0].double(), dim=-1)  # [T, V]
        top = logprobs.topk(K, dim=-1)
        assert torch.equal(v.ids, top.indices) and torch.equal(s.ids, top.indices)
        torch.testing.assert_close(v.logprobs, top.values.float(), atol=1e-4, rtol=0)
        torch.testing.assert_close(s.logprobs, v.logprobs, atol=1e-4, rtol=0)
    ours = generate(reference, SEQUENCES, 6, K)
    for a, b, tokens in zip(gen_v, gen_s, ours.tokens):
        assert a.tokens.tolist() == b.tokens.tolist() == tokens
        assert torch.equal(a.ids, b.ids)
    # stop_token_ids (GSM8K's requests): each generation ends at its first stop token, kept
    stop = [ours.tokens[0][2]]
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        post = post_json(client)
        stopped = [d(post, "tiny-gqa").complete(SEQUENCES, 6, stop) for d in (VllmDialect, SglangDialect)]
    want = [t[:t.index(stop[0]) + 1] if stop[0] in t else t for t in ours.tokens]
    assert stopped[0] == stopped[1] == want and len(want[0]) <= 3


def test_bad_requests_are_400_and_metrics_use_vllm_names(server: Server) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        bad = client.post("/v1/completions", json={"prompt": [1, 5000], "max_tokens": 1})
        assert bad.status_code == 400 and "token id 5000 is out of range" in bad.json()["message"]
        bad = client.post("/generate", json={"text": "x", "sampling_params": {"temperature": 1.0, "top_p": 2}})
        assert bad.status_code == 400 and bad.json()["message"] == "sampling: top_p=2.0 must be in (0, 1]"
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-gqa"
        metrics = client.get("/metrics").text
    assert "vllm:spec_decode_num_accepted_tokens_total" in metrics and "vllm:prompt_tokens_total" in metrics


def test_server_log_reports_the_kv_pool(server: Server) -> None:
    text = Path(server.log_path).read_text()
    # tp2dcp2: each rank holds both KV heads of tiny-gqa for half of every sequence's tokens
    blocks = int(text.split("harness-serve KV cache: blocks=")[1].split()[0])
    assert f"tokens={blocks * 16 * 2} " in text


def test_ranks_divide_the_cores_as_launched_ranks_do(server: Server) -> None:
    """Each rank gets cores // ranks intra-op threads (like a launch's ranks), not all the cores each."""
    want = int(os.environ["OMP_NUM_THREADS"]) if "OMP_NUM_THREADS" in os.environ else \
        threads_per_process(2, available_cores(), os.environ.get(THREADS_ENV))
    assert httpx.get(f"{server.base_url}/server_info").json()["threads_per_rank"] == [want, want]


def test_sampled_requests_draw_with_the_engines_sampler_from_their_own_seeds(server: Server,
                                                                            reference: Engine) -> None:
    """Both dialects sample with the embedded engine's sampler (tp1 here, tp2dcp2 behind the server): the same tokens
    from the same per-request seeds, alone or in a batch, and vLLM's n children seeded seed + j."""
    params = SamplingParams(temperature=1.5, top_k=12, top_p=0.95, min_p=0.05, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.2)
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        post = post_json(client)
        vllm = VllmDialect(post, "tiny-gqa").generate(SEQUENCES, 6, K, True, sampling=params, seeds=[11, 12])
        sglang = SglangDialect(post, "tiny-gqa").generate(SEQUENCES[::-1], 6, K, True, sampling=params,
                                                          seeds=[12, 11])
        draws = VllmDialect(post, "tiny-gqa").draw(SEQUENCES[0], params, 40, 3)
        logprobs = client.post("/v1/completions", json={"prompt": SEQUENCES[0], "max_tokens": 6, "seed": 11,
                                                        "logprobs": 1, **sampling_fields(params)}
                               ).json()["choices"][0]["logprobs"]
    ours = generate(reference, SEQUENCES, 6, K, sampler=Sampler.of(params, reference.spec.vocab, 1, 0),
                    seeds=[11, 12])
    assert [g.tokens.tolist() for g in vllm] == ours.tokens == [g.tokens.tolist() for g in sglang[::-1]]
    alone = [generate(reference, [SEQUENCES[0]], 1, K, sampler=Sampler.of(params, reference.spec.vocab, 1, 0),
                      seeds=[s]).tokens[0][0] for s in (40, 41, 42)]
    assert draws == alone
    # a sampled step's logprob is the drawn token's own (not the top-1's)
    full = torch.log_softmax(reference.prefill_logits([SEQUENCES[0] + ours.tokens[0][:1]])[0].double(), dim=-1)
    assert logprobs["token_logprobs"][1] == pytest.approx(float(full[-1, ours.tokens[0][1]]), abs=1e-4)
