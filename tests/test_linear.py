"""The engine's matmuls against fixed weights (harness/engine/layers/linear.py) and its bounded forwards
(token_groups): the packed oneDNN path computes x @ w.T (to rounding) where its rule sends a call, torch's
matmul (the same bits) elsewhere, and a generation split into more forwards gives the same tokens."""

from __future__ import annotations

import pytest
import torch

import harness.engine.runtime.scheduler as scheduler
from harness.engine.layers.linear import PACK_MIN, PACK_ONE_ROW_MIN, PACK_WORK, Linear, matmul_t
from harness.engine.runtime.engine import Engine, token_groups
from harness.engine.runtime.parallel import ParallelState
from harness.engine.runtime.scheduler import generate
from harness.formats.locate import load_model
from harness.formats.weights import load_weights
from harness.specs.pool import PoolSettings

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("shape", [(96, 64), (640, 512), (4096, 288)])
def test_packed_matmul_is_x_times_w_transposed(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g)
    lin = Linear(w)
    assert lin.packed is not None
    for rows in (1, 3, 16, 1024):
        x = torch.randn(rows, 2, shape[1], generator=g)[:, 1]  # [rows, K], a strided view
        got, want = lin(x), x @ w.T
        n = w.numel()
        routed = rows * n >= PACK_WORK or (rows > 1 and n >= PACK_MIN) or n >= PACK_ONE_ROW_MIN
        assert lin.packs(rows) == routed
        if routed:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)
        else:
            assert torch.equal(got, want)  # torch's own matmul
    batched = torch.randn(2, 5, shape[1], generator=g)  # [B, S, K] -> [B, S, N]
    torch.testing.assert_close(lin(batched), batched @ w.T, rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_sums_in_float32_and_rounds_once(dtype: torch.dtype) -> None:
    """As a GPU's half-precision GEMM: operands widened exactly, products summed in float32, one rounding."""
    g = torch.Generator().manual_seed(1)
    small, large = torch.randn(64, 48, generator=g).to(dtype), torch.randn(640, 512, generator=g).to(dtype)
    x_small, x_large = torch.randn(3, 48, generator=g).to(dtype), torch.randn(16, 512, generator=g).to(dtype)
    lin = Linear(small)
    assert not lin.packs(3) and lin.weight is small  # torch's float32 matmul here; the weight stays as loaded
    widened = (x_small.float() @ small.float().T).to(dtype)
    assert lin(x_small).dtype == dtype and torch.equal(lin(x_small), widened)
    assert torch.equal(matmul_t(x_small, small), widened)
    packed = Linear(large)  # the widened weight is packed by the float32 rule
    assert packed.packs(16)
    got, want = packed(x_large), (x_large.float() @ large.float().T).to(dtype)
    # another float32 summation order (oneDNN's), then one rounding each: a last place of the dtype apart at most,
    # or float32's own error where the sum cancels
    scale = x_large.float().abs() @ large.float().abs().T  # [16, 640]
    bound = 2 * torch.finfo(dtype).eps * want.float().abs() + 1e-6 * scale
    assert got.dtype == dtype and bool(((got.float() - want.float()).abs() <= bound).all())


def test_token_groups_bound_each_forward() -> None:
    lengths = [100, 900, 30, 2000, 5000, 40, 40]
    groups = token_groups(range(len(lengths)), lengths, limit=2048)
    assert [i for g in groups for i in g] == list(range(len(lengths)))  # every row once, in order
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 2048  # a longer row alone
    assert [4] in groups and token_groups([0, 2], lengths, limit=2048) == [[0, 2]]


def test_more_forwards_give_the_same_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_model("tiny-gqa")
    engine = Engine(spec, load_weights(spec), ParallelState.single("cpu"),
                    pool=PoolSettings(budget_bytes=1 << 26, max_seq_len=128))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (37, 64, 5, 50, 2, 64)]
    whole = generate(engine, prompts, 8)
    monkeypatch.setattr(scheduler, "FORWARD_TOKENS", 64)  # every prefill row in a forward of its own
    split = generate(engine, prompts, 8)
    assert split.tokens == whole.tokens
    for a, b in zip(split.topk_logprobs, whole.topk_logprobs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # rounding: other row counts per matmul
