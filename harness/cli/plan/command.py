"""`harness plan`: the per-rank layout of a model over a topology, as a table or JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from harness.arch.document import plan_sections
from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.cli.checks import bounded_float, bounded_int, positive_int
from harness.cli.plan.hybrid import render_hybrid, render_moe
from harness.cli.plan.pd import pd_section, render_pd
from harness.cli.plan.sparse import render_sparse
from harness.cli.resources import activations, weight_bytes
from harness.core.errors import ConfigError
from harness.core.fmt import human_bytes, id_ranges, table
from harness.core.limits import MAX_KV_BUDGET_MIB, MAX_SEQ_LEN
from harness.formats.locate import load_model
from harness.partition.layout import LAYOUT_SCHEMA_VERSION, token_owner
from harness.specs.model import ModelSpec
from harness.specs.topology import load_catalog

GIB = 1024 ** 3


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="per-rank head/KV layout of a model over a topology")
    p.add_argument("--model", required=True, help="shipped model name, model spec .yaml, checkpoint or .gguf")
    p.add_argument("--topo", required=True, help="one topology, e.g. tp4dcp4 or tp8dcp2-mtp")
    p.add_argument("--budget-gib", type=bounded_float(MAX_KV_BUDGET_MIB / 1024, "GiB"),
                   default=None, help="KV memory budget per rank, GiB")
    p.add_argument("--max-seq-len", type=bounded_int(MAX_SEQ_LEN, "tokens"),
                   default=None, help="tokens per sequence slot (default: model's)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    p.add_argument("--tokens", type=positive_int, default=16,
                   help=f"show the DCP owner of each token of a sequence this long (its whole prompt; at most "
                        f"{MAX_TOKENS})")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.set_defaults(func=run)


MAX_TOKENS = 65536  # --tokens lists one owner per token: a longer sequence is no layout to read, only a huge line


def plan_document(model: ModelSpec, topo_name: str, budget_gib: float | None, max_seq_len: int | None,
                  block_size: int, tokens: int = 16) -> dict[str, Any]:
    """The versioned JSON document of `harness plan` (schema in README, 'harness plan --format json')."""
    if tokens > MAX_TOKENS:
        raise ConfigError(f"--tokens {tokens}: at most {MAX_TOKENS} (the owner of every token is listed; the "
                          f"placement repeats every dcp x chunk tokens, so a shorter sequence shows it)")
    topos = load_catalog().resolve(topo_name)
    if len(topos) != 1:
        raise ConfigError(f"--topo {topo_name!r} names {len(topos)} topologies; plan takes exactly one")
    topo = topos[0]
    seq = max_seq_len or model.max_seq_len
    planned = plan_model(model_of(model), topo)
    sections = plan_sections(planned, None if budget_gib is None else int(budget_gib * GIB), seq, block_size)
    doc: dict[str, Any] = {"schema_version": LAYOUT_SCHEMA_VERSION, "model": model.name,
                           "topology": topo.to_dict(), **sections}
    if model.engine_gaps:  # what the checkpoint has that the embedded engine does not run (planned all the same)
        doc["engine_gaps"] = list(model.engine_gaps)
    doc["token_owners"] = {"tokens": tokens, "prompt_len": tokens,
                           "owners": [token_owner(t, topo.dcp, topo.placement, tokens) for t in range(tokens)]}
    if planned.pd is not None:  # only disaggregated topologies carry the section (other documents unchanged)
        doc["pd"] = pd_section(planned.pd, planned.pd_state, tokens, block_size)
    return doc


def _span(bounds: list[int]) -> str:
    """[lo, hi) as 'lo-(hi-1)'; '-' when empty."""
    lo, hi = bounds
    return f"{lo}-{hi - 1}" if hi > lo else "-"


def render_table(doc: dict[str, Any]) -> str:
    rows = [[str(r["rank"]), id_ranges(r["q_heads"]), id_ranges(r["kv_heads"]), str(r["dcp_group"]),
             str(r["dcp_rank"]), str(r["kv_tp_rank"]), id_ranges(r["q_to_kv"]), _span(r["vocab_shard"]),
             _span(r["ffn_shard"])] for r in doc["ranks"]]
    out = [f"model {doc['model']} on {doc['topology']['name']} (tp={doc['tp']}, dcp={doc['dcp']}, "
           f"kv_tp_size={doc['kv_tp_size']}, gcd={doc['kv_gcd']})",
           table(["rank", "q_heads", "kv_heads", "dcp_group", "dcp_rank", "kv_tp_rank", "reads_kv", "vocab",
                  "ffn"], rows),
           f"KV bytes/token per rank (stored token): {doc['kv_bytes_per_token_per_rank']} "
           f"({human_bytes(doc['kv_bytes_per_token_per_rank'])})",
           f"KV bytes/token per DCP group: {doc['kv_bytes_per_token_per_dcp_group']}; "
           f"all ranks: {doc['kv_bytes_per_token_total']}",
           f"KV duplication: x{doc['kv_duplication']} (ranks holding each KV head: {doc['kv_replicas']})"]
    owners = doc["token_owners"]
    if doc["dcp"] > 1:
        out.append(f"DCP placement: {doc['placement']['label']}; owner (DCP rank) of tokens 0-{owners['tokens'] - 1} "
                   f"of a {owners['prompt_len']}-token prompt: {' '.join(str(o) for o in owners['owners'])}")
    if doc["mla"]:
        out += _mla_lines(doc["mla"], doc["tp"], doc["dcp"])
    cap = doc["capacity"]
    if cap:
        out.append(f"capacity per rank: {cap['slots']} slots of {cap['max_seq_len']} tokens = {cap['blocks']} "
                   f"blocks x {cap['block_size']} tokens ({human_bytes(cap['pool_bytes'])} of "
                   f"{human_bytes(cap['budget_bytes'])})")
    spec = doc["speculator"]
    if spec:
        out.append(f"speculator ({spec['kind']}, plain TP layout, dcp=1): KV heads per rank "
                   + ", ".join(f"r{r['rank']}:{id_ranges(r['kv_heads'])}" for r in spec["ranks"])
                   + f"; {spec['kv_bytes_per_token_per_rank']} bytes/token per rank")
    if doc["hybrid"]:
        out += render_hybrid(doc["hybrid"])
    if "sparse" in doc:
        out += render_sparse(doc["sparse"])
    if doc.get("pd"):
        out += render_pd(doc["pd"], doc["mla"] is not None)
    if doc.get("moe"):
        out += render_moe(doc["moe"])
    if doc.get("engine_gaps"):
        out.append(f"not run by the embedded engine (served by vllm / sglang): {'; '.join(doc['engine_gaps'])}")
    return "\n".join(out)


def _mla_lines(mla: dict[str, Any], tp: int, dcp: int) -> list[str]:
    """The MLA part of the table: each rank's Q heads, the heads whose Q weights it holds, its latent bytes."""
    gathered = ("no DCP group: each rank attends with its own heads" if dcp == 1 else
                "group queries computed locally" if mla["q_mode"] == "replicated" else
                "group queries all-gathered in the DCP group")
    rows = [[str(r["rank"]), id_ranges(r["q_heads"]), id_ranges(r["q_weight_heads"]), str(r["latent_bytes_per_token"]),
             human_bytes(r["q_weight_bytes"])] for r in mla["ranks"]]
    where = "every rank" if dcp == 1 else "its owner rank in each DCP group"
    return [f"MLA: latent row {mla['latent_dim']} = kv_lora_rank {mla['kv_lora_rank']} + qk_rope_dim "
            f"{mla['qk_rope_dim']} values per token and layer, shared by all heads; Q mode {mla['q_mode']} "
            f"({gathered})",
            table(["rank", "q_heads", "q_weights", "latent_B/token", "q_weight_bytes"], rows),
            f"latent row of each token stored on {where}: duplication x{mla['latent_duplication']} "
            f"over {tp} ranks"]


def memory_section(model: ModelSpec, tp: int, max_seq_len: int) -> dict[str, Any]:
    """The memory `harness run` checks before work (harness/cli/resources.py): the
    whole model's weights as float32 (the reference loads them in one process) and the peak activations of one
    `max_seq_len`-token prefill, per rank at `tp` and for the reference (tp=1)."""
    return {"weight_bytes_float32": weight_bytes(model), "activations": activations(model, tp, max_seq_len).to_dict(),
            "reference_activations": activations(model, 1, max_seq_len).to_dict()}


def render_memory(memory: dict[str, Any]) -> str:
    act, ref = memory["activations"], memory["reference_activations"]
    per_rank, all_ranks = human_bytes(act["peak_bytes_per_rank"]), human_bytes(act["peak_bytes_all_ranks"])
    return (f"peak activations of one {act['tokens']}-token prefill (float32): {per_rank} per rank, {all_ranks} "
            f"over {act['ranks']} ranks; reference (tp=1): {human_bytes(ref['peak_bytes_per_rank'])} + weights "
            f"{human_bytes(memory['weight_bytes_float32'])}")


def run(args: argparse.Namespace) -> int:
    model = load_model(args.model)
    doc = plan_document(model, args.topo, args.budget_gib, args.max_seq_len, args.block_size, args.tokens)
    doc["memory"] = memory_section(model, doc["tp"], args.max_seq_len or model.max_seq_len)
    print(json.dumps(doc, indent=2) if args.format == "json" else
          render_table(doc) + "\n" + render_memory(doc["memory"]))
    return 0
