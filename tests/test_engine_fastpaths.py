"""The decoder's fast paths give bit-identical results to the general ones: a first forward attends to its
new K/V as they are (no read back from the pool), and q and k are rotated in one kernel where they are
adjacent views of the fused projection."""

from __future__ import annotations

import pytest
import torch

from harness.engine.engine import Engine
from harness.engine.faults import FaultFlags, fault_flags
from harness.engine.model import apply_rope, rope_qk, rope_tables
from harness.engine.parallel import ParallelState
from harness.engine.weights import load_weights
from harness.specs.checkpoint import load_model
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
