"""Faults in speculative decoding (speculator.py, decoding.py; the served logprobs of harness/serve/executor.py): each
reproduces one real bug of this code behind a flag (harness/engine/fault.py); the catalog (harness/engine/faults.py)
gathers them."""

from __future__ import annotations

from harness.engine.fault import Fault

FAULTS: tuple[Fault, ...] = (
    Fault("draft-dcp-kv-heads", "speculator_layout",
          "the speculator's KV heads and KV pool computed with the target's dcp (kv_tp_size = tp // dcp) "
          "although it is not part of the DCP group: its KV pool is over-allocated (SGLang draft worker, "
          "CI OOM); output and acceptance unchanged", needs_dcp=True, needs_speculator="any",
          flags={"speculator_kv_dcp": True}),
    Fault("draft-stale-kv", "acceptance, acceptance_per_position",
          "rejected draft tokens' K/V not rolled back in the speculator's cache, so later proposals attend "
          "to them: acceptance drops, greedy output stays lossless", needs_speculator="any",
          flags={"speculator_stale_kv": True}),
    Fault("mtp-wrong-hidden", "acceptance",
          "the MTP module fed the target's hidden state of the wrong position (t-1 instead of t): its "
          "proposals change (a trained MTP's acceptance drops; a synthetic one's accept trace leaves the "
          "reference's), greedy output stays lossless", needs_speculator="mtp",
          flags={"mtp_hidden_shift": 1}),
    Fault("spec-verify-last-draft", "acceptance_baseline, acceptance_per_position",
          "the verify step's accept loop bounded by k - 1 instead of k (the bonus position taken for the "
          "last draft position), so the last proposal is never accepted and the target's own token is "
          "committed in its place: output stays lossless and identical in the tp1 reference, which shares "
          "the verify code, but fully accepted steps (k + 1 tokens) never happen and the mean accepted "
          "length drops", needs_speculator="any", shared=True,
          flags={"verify_skip_last": True}),
    Fault("mtp-dcp-hidden-owner", "acceptance",
          "under DCP the MTP module fed the target hidden state of the latest position owned by DCP rank 0 "
          "(q - q % dcp) instead of q, the same wrong state on every rank, as a draft built for dcp=1 would "
          "(local-inference-lab vLLM #72): every cross-rank comparison agrees, greedy output stays lossless, "
          "the proposals change", needs_dcp=True, needs_speculator="mtp",
          flags={"mtp_hidden_dcp_owner": True}),
    Fault("spec-logprob-shift", "speculative_logprobs",
          "a speculative server returns each generated step's logprobs from the row after it (the verify "
          "forward's rows indexed from the first draft instead of the last committed token): tokens and "
          "acceptance unchanged, the logprobs a client reads are those of the next position; acts behind "
          "`harness serve` (the embedded engine's speculative path returns no logprobs)", needs_speculator="any",
          flags={"spec_logprob_shift": True}),
)
