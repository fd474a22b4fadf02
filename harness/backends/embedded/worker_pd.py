"""The two worlds of a disaggregated topology (PREFILL>DECODE) in the embedded worker.

The backend launches the prefill world first (`--pd-role prefill`): it prefills every case's prompt on the
prefill layout and sends its KV to the store (harness/engine/pd/prefill.py), then the decode world
(`--pd-role decode`), the cell's run itself: its teacher-forced decode path and its generations load each
prompt's KV through the connector (harness/engine/pd/connector.py) instead of computing it. The decode
world's rank 0 leaves PD_RECORD (the loads, pool accounting, policy, the prefill world's record) and
PD_TENSORS (the digests the prefill ranks sent, those each decode rank holds after placement, the prefill
world's first-token top-k) in the run directory for the pd checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.cases import build_cases, build_workload_cases
from harness.core.errors import ConfigError
from harness.core.jsonio import read_json, write_json
from harness.engine.faults import fault_flags
from harness.engine.pd.connector import KVConnector, LoadPolicy
from harness.engine.pd.prefill import run_prefill
from harness.engine.pd.store import PREFILL_ONLY, PREFILL_RECORD, done_marker, read_entry
from harness.engine.runtime.construct import build_engine
from harness.engine.runtime.engine import Engine, PrefixLoader
from harness.engine.runtime.parallel import ParallelState
from harness.records.contract import MANIFEST_FILE, PD_RECORD_FILE, PD_TENSORS_FILE, Job
from harness.specs.speculative import SpeculativeSettings
from harness.specs.workload import WorkloadPlan

PD_ROLES: tuple[str, ...] = ("prefill", "decode")
PD_RECORD, PD_TENSORS = PD_RECORD_FILE, PD_TENSORS_FILE


def run_prefill_world(job: Job, store: Path) -> None:
    """One prefill rank: the prefill layout's engine (a correct model: the job's fault acts on the transfer
    only), every case's prompt into the store; rank 0 writes the world's record and a manifest."""
    pre = job.topology.prefill
    if pre is None:
        raise ConfigError(f"--pd-role prefill needs a disaggregated topology, got {job.topology.name}")
    state = ParallelState.from_launcher(pre.tp, pre.dcp, job.device, job.collective_timeout_s)
    built = build_engine(state, job.model, pre, None, job.pool, job.dtype, SpeculativeSettings())
    cases = ([case for g in build_workload_cases(WorkloadPlan(job.workloads), job.prompts, built.tokenizer, job.seed,
                                                 job.decode_prefix_tokens) for case in g.cases] if job.workloads
             else build_cases(job.prompts, built.tokenizer, job.seed, job.max_new_tokens, job.decode_prefix_tokens))
    state_plan = plan_model(model_of(job.model), job.topology).pd_state_plan
    # the prompt lengths the decode side loads: the decode path's start, all but the prompt's last token
    cuts = [(c.decode_start, len(c.prompt_ids) - 1) for c in cases]
    record = run_prefill(built.engine, [list(c.prompt_ids) for c in cases], store, job.top_k,
                         fault_flags(job.fault, job.topology), cuts,
                         state_plan.prefill[state.rank] if state_plan is not None else None)
    ranks = state.gather_objects(record.to_dict())
    if state.rank == 0:
        write_json(store / PREFILL_RECORD, {"topology": pre.to_dict(), "ranks": ranks,
                                            "requests": [{"index": i, "case": c.index, "tokens": len(c.prompt_ids)}
                                                         for i, c in enumerate(cases)]})
        save_file({**{f"topk_ids.{i}": t for i, t in enumerate(record.topk_ids)},
                   **{f"topk_logprobs.{i}": t for i, t in enumerate(record.topk_logprobs)}}, str(store / PREFILL_ONLY))
        write_json(Path(job.out_dir) / MANIFEST_FILE, {"status": "ok", "error": None, "role": "prefill",
                                                       "topology": pre.to_dict(), "fault": job.fault})
    state.barrier()
    state.shutdown()


@dataclass
class DecodeSide:
    """The decode world's connector and what it leaves for the checks."""

    job: Job
    engine: Engine
    store: Path
    connector: KVConnector

    @classmethod
    def open(cls, job: Job, engine: Engine, store: Path) -> DecodeSide:
        plan = plan_model(model_of(job.model), job.topology)
        if plan.pd is None:
            raise ConfigError(f"--pd-role decode needs a disaggregated topology, got {job.topology.name}")
        return cls(job, engine, store, KVConnector(engine, plan.pd, store, LoadPolicy(), plan.pd_state_plan))

    def prefetch(self, requests: int) -> None:
        self.connector.prefetch(range(requests))

    def loader(self, route: str) -> PrefixLoader:
        def load(seq_id: int, index: int, tokens: list[int]) -> int:
            return self.connector.load(seq_id, index, tokens, route)
        return load

    def finish(self, out_dir: Path) -> None:
        """Every rank's record and held digests to rank 0, which writes PD_RECORD and PD_TENSORS."""
        state = self.engine.state
        ranks = state.gather_objects((self.connector.close(), self.connector.held, self.connector.held_state))
        if state.rank != 0:
            return
        prefill = read_json(self.store / PREFILL_RECORD)
        tensors: dict[str, torch.Tensor] = {}
        for rec, held, held_state in ranks:
            for key, (digests, positions) in held.items():
                tensors[f"held.{key}.d{rec['rank']}"] = digests
                tensors[f"held.{key}.d{rec['rank']}.pos"] = positions
            for key, digests in held_state.items():
                tensors[f"held_state.{key}.d{rec['rank']}"] = digests
        for req in prefill["requests"]:
            for r in range(self.job.topology.prefill.tp if self.job.topology.prefill else 0):
                if done_marker(self.store, req["index"], r).exists():
                    try:
                        entry = read_entry(self.store, req["index"], r)
                    except (OSError, SafetensorError):  # damaged after the prefill (pd-store-*): its loads failed
                        continue
                    tensors[f"sent.{req['index']}.p{r}"] = entry["digest"]
                    tensors[f"sent.{req['index']}.p{r}.pos"] = entry["pos"]
                    tensors.update({f"sent_state.{req['index']}.p{r}.n{k.rsplit('.', 1)[1]}": t
                                    for k, t in entry.items() if k.startswith("state.digest.")})
        tensors.update({f"prefill_only.{k}": t for k, t in load_file(str(self.store / PREFILL_ONLY)).items()})
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / PD_TENSORS))
        doc: dict[str, Any] = {"policy": self.connector.policy.to_dict(), "prefill": prefill,
                               "decode": [rec for rec, _, _ in ranks], "block_size": self.engine.cache.block_size}
        write_json(out_dir / PD_RECORD, doc)
