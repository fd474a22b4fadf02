"""`harness serve` as one side of disaggregated prefill/decode (`--pd-role prefill|decode --pd-store ROOT`, a
PREFILL>DECODE topology): the embedded engine's own P/D path (harness/engine/pd/prefill.py, pd_connector.py)
behind HTTP, the two servers sharing the KV store folder ROOT.

A completion that carries `kv_transfer_params` {"namespace": NS, "requests": [index per prompt]} (vLLM's P/D
request field; the client names one folder per run) is a P/D request:
- on the prefill server it is prefilled on the prefill layout and its KV sent to ROOT/NS/req{index}/ (pd_store's
  layout, the send completing one request later as in the embedded prefill world); the answer is the first new
  token with its top-k (the prefill-only result), whatever max_tokens asked;
- on the decode server its generation loads the prompt's KV (all but the last token) through a KVConnector on
  ROOT/NS (waiting / loading / loaded / failed, the load policy) instead of computing it.
A completion without it runs as on any server (prompt logprobs, plain generation).

Each rank leaves its own record of every batch in ROOT/NS (no collective: the client assembles them,
harness/backends/http/pd.py): the prefill ranks `prefill.p{rank}.jsonl` (one line per batch: pool free blocks
before and after, requests sent and lost), the decode ranks `decode/d{rank}.b{batch}.json` (the connector's
record: loads, pool, policy, block size) and `decode/d{rank}.b{batch}.safetensors` (the digests of the rows it
held right after placement, with their positions).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from harness.engine.fault import FaultFlags
from harness.engine.pd.connector import KVConnector, LoadPolicy
from harness.engine.pd.prefill import run_prefill
from harness.engine.runtime.engine import Engine, PrefixLoader
from harness.partition.pd_layout import PDPlan
from harness.records.pd_files import decode_record, prefill_log
from harness.serve.executor import Abandoned, execute
from harness.serve.protocol import Completion, CompletionResult, KVTransfer, TokenLogprob

ROUTE = "generation"  # the only route a server loads on (HTTP has no teacher-forced decode path)


def _split(batch: list[Completion]) -> tuple[list[int], list[int]]:
    """Indices of the batch's P/D completions and of the others."""
    pd = [i for i, c in enumerate(batch) if c.kv is not None]
    return pd, [i for i, c in enumerate(batch) if c.kv is None]


def _sub(abandoned: Abandoned, index: list[int]) -> Abandoned:
    return lambda: frozenset(j for j, i in enumerate(index) if i in abandoned())


@dataclass
class PrefillServer:
    """The prefill server's executor: P/D completions into the store, the others as usual."""

    engine: Engine
    root: Path
    flags: FaultFlags  # the transfer faults of the served topology (the model itself is correct)

    def execute(self, batch: list[Completion], eos_id: int | None, abandoned: Abandoned) -> list[CompletionResult]:
        pd, plain = _split(batch)
        results: dict[int, CompletionResult] = {}
        if plain:
            results.update(zip(plain, execute(self.engine, [batch[i] for i in plain], eos_id, None,
                                              _sub(abandoned, plain))))
        key = lambda i: batch[i].kv.namespace if batch[i].kv else ""  # noqa: E731
        for namespace, members in groupby(sorted(pd, key=key), key=key):
            index = list(members)
            results.update(zip(index, self._prefill(namespace, [batch[i] for i in index])))
        return [results[i] for i in range(len(batch))]

    def _prefill(self, namespace: str, group: list[Completion]) -> list[CompletionResult]:
        store = self.root / namespace
        store.mkdir(parents=True, exist_ok=True)
        top_k = max(1, *(c.top_k for c in group))
        requests = [c.kv.request for c in group if c.kv is not None]
        record = run_prefill(self.engine, [c.prompt for c in group], store, top_k, self.flags, indices=requests)
        with prefill_log(store, self.engine.state.rank).open("a") as f:
            f.write(json.dumps(record.to_dict()) + "\n")
        out = []
        for c, ids, lps in zip(group, record.topk_ids, record.topk_logprobs):
            top = [(int(i), float(v)) for i, v in zip(ids[:c.top_k], lps[:c.top_k])]
            first = TokenLogprob(token=int(ids[0]), logprob=float(lps[0]), rank=1, top=top)
            out.append(CompletionResult(tokens=[int(ids[0])], logprobs=[first], prompt_logprobs=None,
                                        finish_reason="length"))
        return out


@dataclass
class DecodeServer:
    """The decode server's executor: each P/D generation's prompt KV loaded through a connector per namespace."""

    engine: Engine
    plan: PDPlan
    root: Path
    policy: LoadPolicy = LoadPolicy()
    batches: int = 0
    _connectors: dict[str, KVConnector] = field(default_factory=dict)

    def execute(self, batch: list[Completion], eos_id: int | None, abandoned: Abandoned) -> list[CompletionResult]:
        self.batches += 1
        self._connectors = {}
        try:
            return execute(self.engine, batch, eos_id, None, abandoned, self._loader)
        finally:
            self._finish()

    def _loader(self, group: list[Completion]) -> PrefixLoader | None:
        kvs: list[KVTransfer | None] = [c.kv for c in group]
        if all(kv is None for kv in kvs):
            return None
        for kv in kvs:
            if kv is not None and kv.namespace not in self._connectors:
                self._connectors[kv.namespace] = KVConnector(self.engine, self.plan, self.root / kv.namespace,
                                                             self.policy)
        for namespace, connector in self._connectors.items():  # every request's read starts now, once
            connector.prefetch(sorted({kv.request for kv in kvs if kv is not None and kv.namespace == namespace}))

        def load(seq_id: int, local: int, tokens: list[int]) -> int:
            kv = kvs[local]
            if kv is None:
                return 0  # a plain prompt of the same group: computed
            return self._connectors[kv.namespace].load(seq_id, kv.request, tokens, ROUTE)
        return load

    def _finish(self) -> None:
        """Each connector's record and held digests into its namespace (this rank's files of this batch)."""
        rank = self.engine.state.rank
        for namespace, connector in self._connectors.items():
            record: dict[str, Any] = {**connector.close(), "policy": self.policy.to_dict(),
                                      "block_size": self.engine.cache.block_size}
            path = decode_record(self.root / namespace, rank, self.batches)
            path.parent.mkdir(parents=True, exist_ok=True)
            tensors: dict[str, torch.Tensor] = {}
            for key, (digests, positions) in connector.held.items():
                tensors[f"held.{key}.d{rank}"] = digests.contiguous()
                tensors[f"held.{key}.d{rank}.pos"] = positions.contiguous()
            save_file(tensors, str(path.with_suffix(".safetensors")))
            path.write_text(json.dumps(record))
        self._connectors = {}
