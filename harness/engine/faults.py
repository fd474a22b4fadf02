"""Known-bug injections: each reproduces one real layout bug class, silently, only in parallel runs."""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import ConfigError
from harness.specs.loader import did_you_mean
from harness.specs.topology import Topology


@dataclass(frozen=True)
class Fault:
    """A bug the engine can be told to have; `check` is the check that must flag it."""

    name: str
    check: str
    description: str
    needs_dcp: bool = False
    needs_speculator: str = ""  # "": none; "any": a draft or MTP speculator; "draft" / "mtp": that kind


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("dcp-tp-kv-layout", "layout, logits_decode",
          "under DCP, KV heads assigned by the TP-only layout (kv_tp_size = tp), so ranks of one DCP group "
          "hold different KV heads and the merged attention mixes them (SGLang Qwen3.5 TP4/DCP4: GSM8K 0.880)",
          needs_dcp=True),
    Fault("gcd-naive-gqa", "layout, logits",
          "the local Q->KV mapping by repeat_interleave of local head counts instead of global head indices "
          "(wrong when KV heads are GCD-duplicated, e.g. heads=24 kv=6 tp=4; rtp-llm)"),
    Fault("dcp-lse-merge", "logits_decode",
          "DCP partial attention outputs averaged without their log-sum-exp weights", needs_dcp=True),
    Fault("dcp-token-owner", "logits_decode",
          "during decode the new token's K/V is stored on every rank of its DCP group instead of only on its "
          "owner (t % dcp), so the LSE merge counts it several times", needs_dcp=True),
    Fault("draft-dcp-kv-heads", "speculator_layout",
          "the speculator's KV heads and KV pool computed with the target's dcp (kv_tp_size = tp // dcp) "
          "although it is not part of the DCP group: its KV pool is over-allocated (SGLang draft worker, "
          "CI OOM); output and acceptance unchanged", needs_dcp=True, needs_speculator="any"),
    Fault("draft-stale-kv", "acceptance",
          "rejected draft tokens' K/V not rolled back in the speculator's cache, so later proposals attend "
          "to them: acceptance drops, greedy output stays lossless", needs_speculator="any"),
    Fault("mtp-wrong-hidden", "acceptance",
          "the MTP module fed the target's hidden state of the wrong position (t-1 instead of t): its "
          "proposals change (a trained MTP's acceptance drops; a synthetic one's accept trace leaves the "
          "reference's), greedy output stays lossless", needs_speculator="mtp"),
)}


@dataclass(frozen=True)
class FaultFlags:
    """What the engine does differently under a fault (all False/None = correct engine)."""

    kv_layout_dcp: int | None = None
    naive_gqa: bool = False
    lse_merge_mean: bool = False
    store_on_all_dcp_ranks: bool = False
    speculator_kv_dcp: bool = False     # draft-dcp-kv-heads: speculator KV split by tp // dcp
    speculator_stale_kv: bool = False   # draft-stale-kv: no rollback of the speculator's cache
    mtp_hidden_shift: int = 0           # mtp-wrong-hidden: MTP reads the target hidden this many positions early


def fault_flags(name: str | None, topology: Topology) -> FaultFlags:
    """The engine switches for fault `name` on `topology`; a fault that cannot apply is a ConfigError."""
    if name is None:
        return FaultFlags()
    if name not in FAULTS:
        raise ConfigError(f"unknown fault {name!r}{did_you_mean(name, tuple(FAULTS))}; valid: {', '.join(FAULTS)}")
    fault = FAULTS[name]
    if fault.needs_dcp and topology.dcp == 1:
        raise ConfigError(f"fault {name} needs a DCP topology (dcp > 1), got {topology.name}")
    wanted = fault.needs_speculator
    if wanted and (topology.speculator == "none" or wanted not in ("any", topology.speculator)):
        kind = "a -draft or -mtp" if wanted == "any" else f"a -{wanted}"
        raise ConfigError(f"fault {name} needs {kind} topology (speculative decoding), got {topology.name}")
    return FaultFlags(
        kv_layout_dcp=1 if name == "dcp-tp-kv-layout" else None,
        naive_gqa=name == "gcd-naive-gqa",
        lse_merge_mean=name == "dcp-lse-merge",
        store_on_all_dcp_ranks=name == "dcp-token-owner",
        speculator_kv_dcp=name == "draft-dcp-kv-heads",
        speculator_stale_kv=name == "draft-stale-kv",
        mtp_hidden_shift=1 if name == "mtp-wrong-hidden" else 0,
    )
