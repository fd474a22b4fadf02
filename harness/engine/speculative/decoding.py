"""Greedy speculative decoding: a speculator proposes k tokens, the target verifies them in one forward.

One step over a batch of sequences (every rank in lockstep, all ranks get the same tokens):
  1. catch-up + propose: the speculator is fed the committed tokens it has not seen with exact inputs
     (from position `spec_valid` to the last committed token), then k - 1 more one-token steps on its own
     proposals; its greedy picks are the proposals d_1..d_k;
  2. verify: the target is fed [last committed token, d_1..d_k] at positions n-1..n-1+k (the extend path
     of its KV cache) and picks y_0..y_k greedily;
  3. accept the longest prefix with d_i == y_{i-1} (a tokens, 0..k) plus the target's own next token
     y_a: a + 1 tokens are committed per step, exactly the tokens plain greedy decoding would give;
  4. roll back: the target's cache keeps positions < n + a (rejected proposals dropped); the speculator's
     keeps only entries computed from exact inputs (a draft model: positions < n + min(a, k - 1); an MTP
     module: positions < n, since its proposal-chain entries were fed its own hidden states) and
     recomputes the rest with the next catch-up.

Metrics. `accepted[i]` of a sequence is the number of accepted draft tokens at verify step i (0..k).
The *accepted length* of a step is accepted + 1: the tokens committed per target forward (the usual
"acceptance length" of EAGLE/MTP reports; 1.0 means the speculator never helps, k + 1 is the maximum).

Faults (see faults.py): draft-stale-kv skips the speculator's rollback (stale entries stay visible);
mtp-wrong-hidden pairs each token with the target hidden state one position too early;
spec-verify-last-draft bounds the accept loop by k - 1 (in the reference too: it is shared code).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from harness.core.acceptance import histogram, mean_accepted_length
from harness.core.errors import ConfigError
from harness.engine.runtime.engine import Engine
from harness.engine.speculative.speculator import Speculator
from harness.records.contract import SPEC_ACCEPTED, SPEC_DRAFTS, SPEC_TOKENS
from harness.specs.speculative import SpeculativeSettings

__all__ = ["SeqState", "SpecResult", "SpeculativeDecoder", "SpeculativeSettings", "spec_manifest", "spec_tensors"]


@dataclass
class SeqState:
    """One sequence being decoded: committed tokens (prompt + generated), its ids in both caches, how far
    the speculator's cache is exact, the target hidden states the MTP still needs, and per-step acceptance."""

    prompt_len: int
    tokens: list[int]
    target_id: int
    spec_id: int
    spec_valid: int
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    accepted: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # the k proposals of each verify step

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass(frozen=True)
class SpecResult:
    """Greedy speculative generation of several prompts.

    tokens[i]: the new tokens of prompt i (at most max_new_tokens; cut after a stop token);
    accepted[i]: accepted draft tokens (0..k) at each verify step of prompt i;
    drafts[i]: the k proposed tokens at each verify step of prompt i."""

    kind: str
    k: int
    tokens: list[list[int]]
    accepted: list[list[int]]
    wall_s: float
    drafts: list[list[list[int]]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return sum(len(a) for a in self.accepted)

    @property
    def histogram(self) -> list[int]:
        """Verify steps per accepted count 0..k, over all prompts."""
        return histogram(self.accepted, self.k)

    @property
    def mean_accepted_length(self) -> float:
        """Mean over all verify steps of (accepted + 1): tokens committed per target forward."""
        return mean_accepted_length(self.accepted)

    def summary(self) -> dict[str, Any]:
        return {"kind": self.kind, "k": self.k, "steps": self.steps, "histogram": self.histogram,
                "mean_accepted_length": self.mean_accepted_length, "wall_s": self.wall_s,
                "new_tokens": sum(len(t) for t in self.tokens)}


def _pick(logits: torch.Tensor) -> list[int]:
    """Greedy token of each row of logits [N, V]."""
    return [int(t) for t in torch.argmax(logits, dim=-1)]


class SpeculativeDecoder:
    """Drives a target Engine and a Speculator of the same rank through greedy speculative decoding: the
    step of a speculative lane of the serving loop (harness/engine/runtime/scheduler.py: speculate)."""

    def __init__(self, target: Engine, speculator: Speculator, k: int) -> None:
        if k < 1:
            raise ConfigError(f"speculative decoding needs k >= 1 draft tokens, got {k}")
        self.target = target
        self.spec = speculator
        self.k = k
        self.stale_kv = speculator.flags.speculator_stale_kv
        self.hidden_shift = speculator.flags.mtp_hidden_shift
        # mtp-dcp-hidden-owner: under DCP the hidden state of the latest position DCP rank 0 owns
        self.owner_dcp = target.state.dcp if speculator.flags.mtp_hidden_dcp_owner else 1
        # drafts the verify step may accept: k (spec-verify-last-draft: k - 1, an off-by-one)
        self.verifiable = k - 1 if speculator.flags.verify_skip_last else k

    # -- sequences -------------------------------------------------------------------------------------------

    def start(self, prompts: Sequence[Sequence[int]],
              load: Callable[[int, int], int] | None = None) -> list[SeqState]:
        """Prefill the target with each prompt and commit its first greedy token. The speculator's cache
        starts empty; the first step's catch-up feeds it the prompt. `load(b, target_seq_id)` (a
        disaggregated run) places prompt b's KV but its last token's and returns how many tokens it placed;
        the target computes the rest."""
        if any(len(p) == 0 for p in prompts):
            raise ConfigError("speculative decoding needs non-empty prompts")
        t_ids = self.target.open_sequences(len(prompts))
        s_ids = self.spec.open_sequences(len(prompts))
        done = [load(b, t) for b, t in enumerate(t_ids)] if load is not None else [0] * len(prompts)
        if any(done) and self.spec.uses_hidden:
            raise ConfigError("a speculator reading the target's hidden states needs the prompt computed, not loaded")
        logits, hidden = self.target.extend(t_ids, [p[n:] for p, n in zip(prompts, done)], done)
        # [B, S, V] rows of each prompt's last token -> B ids
        first = _pick(torch.stack([logits[b, len(p) - 1 - done[b]] for b, p in enumerate(prompts)]))
        seqs = []
        for b, p in enumerate(prompts):
            s = SeqState(prompt_len=len(p), tokens=[*p, first[b]], target_id=t_ids[b], spec_id=s_ids[b],
                         spec_valid=1 if self.spec.uses_hidden else 0)
            if self.spec.uses_hidden:
                s.hidden = {pos: self.spec.target_hidden(hidden[b, pos]) for pos in range(len(p))}
            seqs.append(s)
        return seqs

    def close(self, seqs: Sequence[SeqState]) -> None:
        self.target.close_sequences([s.target_id for s in seqs])
        self.spec.close_sequences([s.spec_id for s in seqs])

    # -- one step --------------------------------------------------------------------------------------------

    def step(self, seqs: Sequence[SeqState]) -> list[int]:
        """One propose / verify / roll-back step of every sequence; returns the accepted counts."""
        drafts = self._propose(seqs)  # [B][k]
        verify = [[s.tokens[-1], *d] for s, d in zip(seqs, drafts)]
        starts = [len(s.tokens) - 1 for s in seqs]
        logits, hidden = self.target.extend([s.target_id for s in seqs], verify, starts)
        out = []
        for b, (s, d) in enumerate(zip(seqs, drafts)):
            picks = _pick(logits[b])  # k + 1 greedy tokens, for positions n .. n + k
            a = 0
            while a < self.verifiable and d[a] == picks[a]:
                a += 1
            s.drafts.append(list(d))
            self._commit(s, d[:a] + [picks[a]], hidden[b, :a + 1], a)
            out.append(a)
        return out

    def _commit(self, s: SeqState, new: list[int], hidden: torch.Tensor, a: int) -> None:
        """Append the accepted tokens and the bonus token; roll both caches back to exact entries."""
        n = len(s.tokens)
        self.target.truncate(s.target_id, n + a)  # keeps x_{n-1} and the a accepted proposals
        s.spec_valid = n if self.spec.uses_hidden else n + min(a, self.k - 1)
        if not self.stale_kv:
            self.spec.truncate(s.spec_id, s.spec_valid)
        if self.spec.uses_hidden:
            for j in range(a + 1):
                s.hidden[n - 1 + j] = self.spec.target_hidden(hidden[j])  # target hidden at positions n-1 .. n-1+a
            oldest = s.spec_valid - 1 - self.hidden_shift - (self.owner_dcp - 1)
            s.hidden = {p: h for p, h in s.hidden.items() if p >= oldest}
        s.tokens += new
        s.accepted.append(a)

    def _propose(self, seqs: Sequence[SeqState]) -> list[list[int]]:
        """Catch-up of each sequence's unseen committed tokens, then k - 1 steps on its own proposals."""
        ids = [s.spec_id for s in seqs]
        chunks = [s.tokens[s.spec_valid:] for s in seqs]
        starts = [s.spec_valid for s in seqs]
        hidden = self._catchup_hidden(seqs, chunks) if self.spec.uses_hidden else None
        logits, x = self.spec.extend(ids, chunks, starts, hidden)
        last = [len(c) - 1 for c in chunks]
        drafts = [[t] for t in _pick(torch.stack([logits[b, i] for b, i in enumerate(last)]))]
        own = torch.stack([x[b, i] for b, i in enumerate(last)])[:, None]  # [B, 1, H]
        for j in range(1, self.k):
            pos = [len(s.tokens) - 1 + j for s in seqs]
            logits, x = self.spec.extend(ids, [[d[-1]] for d in drafts], pos,
                                         own if self.spec.uses_hidden else None)
            for d, t in zip(drafts, _pick(logits[:, 0])):
                d.append(t)
            own = x
        return drafts

    def _catchup_hidden(self, seqs: Sequence[SeqState], chunks: list[list[int]]) -> torch.Tensor:
        """[B, S, H]: for the token at position p, the target hidden state at q = p - 1 (p - 1 - shift under
        mtp-wrong-hidden, clamped at 0; q - q % dcp under mtp-dcp-hidden-owner); zeros in padding."""
        width = max(len(c) for c in chunks)
        ref = next(iter(seqs[0].hidden.values()))
        out = ref.new_zeros((len(seqs), width, ref.shape[-1]))
        for b, (s, c) in enumerate(zip(seqs, chunks)):
            for i in range(len(c)):
                q = max(0, s.spec_valid + i - 1 - self.hidden_shift)
                out[b, i] = s.hidden[q - q % self.owner_dcp]
        return out


def spec_tensors(result: SpecResult, indices: Sequence[int]) -> dict[str, torch.Tensor]:
    """The run directory's tensors of a speculative run, per case index i:
    spec_tokens.{i} [N] int64 (generated tokens) and spec_accepted.{i} [S] int64 (accepted draft tokens
    0..k at each verify step; accepted length = value + 1) and spec_drafts.{i} [S, k] int64 (the
    proposals of each verify step: what the accept-trace localization shows)."""
    out: dict[str, torch.Tensor] = {}
    for i, toks, acc, drafts in zip(indices, result.tokens, result.accepted, result.drafts):
        out[f"{SPEC_TOKENS}.{i}"] = torch.tensor(toks, dtype=torch.long)
        out[f"{SPEC_ACCEPTED}.{i}"] = torch.tensor(acc, dtype=torch.long)
        out[f"{SPEC_DRAFTS}.{i}"] = torch.tensor(drafts, dtype=torch.long).reshape(len(drafts), result.k)  # [S, k]
    return out


def spec_manifest(result: SpecResult, settings: SpeculativeSettings) -> dict[str, Any]:
    """manifest.json's "speculative" entry: kind, settings (k, draft_noise, mtp_hidden_mix) and a summary."""
    return {**settings.to_dict(), **result.summary()}
