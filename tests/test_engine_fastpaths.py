"""The decoder's fast paths give bit-identical results to the general ones: a first forward attends to its
new K/V as they are (no read back from the pool), a right-padded first forward takes the kernel's causal
mask, q and k are rotated in one kernel where they are adjacent views of the fused projection, RMSNorm in
full precision is torch's kernel, and a tp1 embedding is a row lookup."""

from __future__ import annotations

import pytest
import torch

import harness.engine.layers.dense as model
from harness.engine.fault import FaultFlags
from harness.engine.faults import fault_flags
from harness.engine.layers.dense import apply_rope, mask_kind, rms_norm, rope_qk, rope_tables
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.formats.locate import load_model
from harness.formats.weights import load_weights
from harness.specs.pool import PoolSettings
from harness.specs.topology import Topology

LENGTHS = (37, 64, 5, 64, 2, 50)  # right-padded batch: sequences of different lengths


def _engine(model: str, flags: FaultFlags = FaultFlags()) -> Engine:
    spec = load_model(model)
    return Engine(spec, load_weights(spec), ParallelState.single("cpu"), flags=flags,
                  pool=PoolSettings(budget_bytes=1 << 26, max_seq_len=128))


def _sequences(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, min(vocab, 256), (n,), generator=g).tolist() for n in LENGTHS]


def _pooled(engine: Engine) -> list[bool]:
    """Turn the decoder's fresh-prefill path off on this engine (every forward reads its keys from the pool);
    returns the list of the fresh-path decisions the decoder made before the switch, for the caller to check."""
    seen: list[bool] = []
    decide = engine.decoder._fresh_prefill

    def pooled(batch, stored):  # type: ignore[no-untyped-def]
        seen.append(decide(batch, stored))
        return False

    engine.decoder._fresh_prefill = pooled  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("model", ["tiny-gqa", "tiny-9h3kv", "tiny-bf16-big", "tiny-dsa"])
def test_fresh_prefill_equals_pooled_read(model: str) -> None:
    fast, slow = _engine(model), _engine(model)
    seqs = _sequences(fast.spec.vocab)
    decisions = _pooled(slow)
    got, want = fast.prefill_logits(seqs), slow.prefill_logits(seqs)
    assert decisions and all(decisions)  # a first forward of every sequence is fresh
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_extend_after_prefix_is_not_fresh() -> None:
    engine = _engine("tiny-gqa")
    decisions = _pooled(engine)
    ids = engine.open_sequences(2)
    engine.extend(ids, [[1, 2, 3], [4, 5]], [0, 0])
    engine.extend(ids, [[6], [7]], [3, 2])  # a decode step attends to keys stored earlier
    assert decisions == [True, False]


def test_block_table_fault_reads_the_pool() -> None:
    engine = _engine("tiny-gqa", fault_flags("block-table-wrap", Topology(tp=1)))
    decisions = _pooled(engine)
    engine.prefill_logits(_sequences(engine.spec.vocab))
    assert decisions and not any(decisions)  # the fault's wrapped reads must reach attention


def test_joint_rope_equals_separate() -> None:
    g = torch.Generator().manual_seed(0)
    B, S, hq, hkv, hd = 3, 7, 6, 2, 16
    qkv = torch.randn(B, S, (hq + 2 * hkv) * hd, generator=g)
    q, k, _ = qkv.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
    q, k = q.reshape(B, S, hq, hd), k.reshape(B, S, hkv, hd)
    tables = rope_tables(torch.arange(S).expand(B, S), hd, 10000.0, torch.float32)
    joint_q, joint_k = rope_qk(q, k, tables, tables)
    assert torch.equal(joint_q, apply_rope(q, tables)) and torch.equal(joint_k, apply_rope(k, tables))
    other = (tables[0].flip(1), tables[1].flip(1))  # keys by other tables (a fault's): rotated apart
    assert torch.equal(rope_qk(q, k, tables, other)[1], apply_rope(k, other))


def test_padded_first_forward_takes_the_causal_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    padded = causal.clone()
    padded[2:, 2:] = False  # a sequence of 2 real tokens right-padded to 4: its padding sees only the real keys
    visible = torch.stack((causal, padded))  # [2, 4, 4]
    queries = torch.tensor([[True] * 4, [True, True, False, False]])
    assert mask_kind(visible) == "mask" and mask_kind(visible, queries) == "causal"
    seen = visible.clone()
    seen[1, 1, 2] = True  # a real query that sees a padding key: not causal
    assert mask_kind(seen, queries) == "mask"
    for model_name in ("tiny-gqa", "tiny-hybrid"):
        fast = _engine(model_name)
        seqs = _sequences(fast.spec.vocab)
        got = fast.prefill_logits(seqs)
        kinds: list[str] = []

        def general(visible: torch.Tensor, queries: torch.Tensor | None = None) -> str:
            kinds.append(mask_kind(visible, queries))
            return mask_kind(visible)  # the queries' rows ignored: padding makes it an explicit mask

        monkeypatch.setattr(model, "mask_kind", general)
        monkeypatch.setattr("harness.engine.layers.hybrid.mask_kind", general)
        want = _engine(model_name).prefill_logits(seqs)
        monkeypatch.undo()
        assert "causal" in kinds
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_precision_rms_norm_is_the_same_arithmetic(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    for shape in ((1, 1, 64), (16, 7, 576), (3, 5, 4, 24)):
        x = (torch.randn(shape, generator=g) * 3).to(dtype)
        w = torch.randn(shape[-1], generator=g).to(dtype)
        assert torch.equal(rms_norm(x, w, 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)


def test_tp1_embedding_is_the_row_lookup() -> None:
    engine = _engine("tiny-gqa")
    ids = torch.tensor([[0, 5, engine.spec.vocab - 1]])
    assert torch.equal(engine.decoder.embed(ids), engine.decoder.w.embed[ids])
    outside = torch.tensor([[3, engine.decoder.w.vocab_held]])  # an id past the table: the general path's zero row
    rows = engine.decoder.embed(outside)
    assert torch.equal(rows[0, 0], engine.decoder.w.embed[3]) and not rows[0, 1].any()
