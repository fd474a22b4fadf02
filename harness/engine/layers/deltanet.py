"""Gated DeltaNet (linear attention with a recurrent state), one rank's heads, no distributed code.

Per V head h (reading K head kh = h // (v_heads / k_heads)), token t, with q_t, k_t L2-normalized and
q_t scaled by 1 / sqrt(Dk):
    S <- exp(g_t) * S                                   (decay; g_t = -exp(A_log) * softplus(a_t + dt_bias))
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T           (delta rule; beta_t = sigmoid(b_t))
    o_t = S^T q_t                                        (S: [Dk, Dv])
q, k and v first pass a causal depthwise conv1d (kernel K) and SiLU; the conv keeps the last K - 1
inputs as its state. The output is RMS-normed per head, gated by silu(z) and projected out.

Evaluation here is recurrent (one step per token, vectorized over batch and heads) for prefill and
decode alike; tests/test_deltanet.py checks it against a naive per-head loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LinearWeights:
    """One linear-attention layer's local shard (rows per component, see hybrid_layout.plan_linear)."""

    attn_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [Cq + Ck + Cv, H]: q rows of held K heads, k rows of held K heads, v rows of held V heads
    z: torch.Tensor  # [Hv_local * Dv, H]
    b: torch.Tensor  # [Hv_local, H]
    a: torch.Tensor  # [Hv_local, H]
    conv: torch.Tensor  # [Cq + Ck + Cv, K]
    a_log: torch.Tensor  # [Hv_local]
    dt_bias: torch.Tensor  # [Hv_local]
    norm: torch.Tensor  # [Dv]
    out: torch.Tensor  # [H, Hv_local * Dv]: columns of heads this rank does not add are zero


@dataclass(frozen=True)
class LinearHeads:
    n_k: int
    n_v: int
    k_dim: int
    v_dim: int
    v_to_local_k: tuple[int, ...]


@dataclass
class LinearState:
    """One sequence's state in one layer: conv [C, K - 1] (last inputs), recurrent [Hv, Dk, Dv]."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class LinearSteps:
    """The state after each token of one chunk, for a rollback: conv inputs [C, K - 1 + S] (the state
    after j tokens is columns j .. j + K - 2) and recurrent [S + 1, Hv, Dk, Dv] (entry j: after j tokens)."""

    conv_inputs: torch.Tensor
    recurrent: torch.Tensor

    def after(self, j: int, kernel: int) -> LinearState:
        return LinearState(self.conv_inputs[:, j:j + kernel - 1], self.recurrent[j])


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                length: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d of x [S, C] with weight [C, K], continuing from state [C, K - 1] (the
    previous K - 1 inputs, oldest first). Returns (silu(conv) [S, C], new state [C, K - 1]: the last
    K - 1 inputs among the first `length` tokens (default all; right padding after them is ignored),
    and the inputs [C, K - 1 + S] the state after each token is a window of)."""
    kernel, n = weight.shape[1], x.shape[0] if length is None else length
    padded = torch.cat((state, x.T), dim=1)  # [C, K - 1 + S]
    windows = padded.unfold(1, kernel, 1)  # [C, S, K]
    y = (windows * weight[:, None, :]).sum(-1).T  # [S, C]
    return F.silu(y), padded[:, n:n + kernel - 1], padded


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, mask: torch.Tensor | None = None,
               steps: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta recurrence over S tokens for Hv heads: q, k [S, Hv, Dk] (K heads already expanded
    to V heads), v [S, Hv, Dv], g, beta [S, Hv], state [Hv, Dk, Dv]. `mask` [S] (False = token skipped:
    the state is left as it is). Returns (o [S, Hv, Dv], new state); `steps` gets the state before the
    first token and after each one."""
    outs = []
    if steps is not None:
        steps.append(state)
    for t in range(q.shape[0]):
        decayed = state * torch.exp(g[t])[:, None, None]
        kv_mem = torch.einsum("hk,hkv->hv", k[t], decayed)  # [Hv, Dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        new = decayed + k[t][:, :, None] * delta[:, None, :]
        state = new if mask is None else torch.where(mask[t], new, state)
        if steps is not None:
            steps.append(state)
        outs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outs), state


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over each head's Dv values, times weight [Dv], gated by silu(z); o, z [S, Hv, Dv]."""
    calc = state_dtype(o.dtype)
    var = o.to(calc).pow(2).mean(-1, keepdim=True)
    return (o.to(calc) * torch.rsqrt(var + eps)).to(o.dtype) * weight * F.silu(z)


def linear_attention(h: torch.Tensor, w: LinearWeights, heads: LinearHeads, state: LinearState, eps: float,
                     length: int, mask: torch.Tensor | None = None,
                     keep_steps: bool = False) -> tuple[torch.Tensor, LinearState, LinearSteps | None]:
    """One sequence's new tokens h [S, H] (normed; the first `length` valid, the rest padding) through
    one layer; returns (the gated, normed output of this rank's V heads [S, Hv_local * Dv], before the
    row-parallel out projection `w.out` and the TP all-reduce; the new state).
    `mask` [S]: the tokens that update the recurrent state (default: the first `length`). With
    `keep_steps`, also the state after each token (a rollback's snapshots), else None."""
    S = h.shape[0]
    nk, nv, dk, dv = heads.n_k, heads.n_v, heads.k_dim, heads.v_dim
    mixed, conv_state, conv_inputs = causal_conv(h @ w.qkv.T, w.conv, state.conv, length)  # [S, C]
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    idx = torch.tensor(heads.v_to_local_k, device=h.device)
    calc = state_dtype(h.dtype)
    # [S, nk * dk] -> [S, nk, dk] -> per V head [S, nv, dk]
    q = F.normalize(q.reshape(S, nk, dk).to(calc), dim=-1)[:, idx] * dk ** -0.5
    k = F.normalize(k.reshape(S, nk, dk).to(calc), dim=-1)[:, idx]
    v = v.reshape(S, nv, dv).to(calc)  # [S, nv, dv]
    beta = torch.sigmoid((h @ w.b.T).to(calc))  # [S, nv]
    g = -torch.exp(w.a_log.to(calc)) * F.softplus((h @ w.a.T).to(calc) + w.dt_bias.to(calc))  # [S, nv]
    if mask is None:
        mask = torch.arange(S, device=h.device) < length
    steps: list[torch.Tensor] | None = [] if keep_steps else None
    o, rec = delta_rule(q, k, v, g, beta, state.recurrent, mask, steps)
    z = (h @ w.z.T).reshape(S, nv, dv)  # [S, nv * dv] -> [S, nv, dv]
    y = gated_rms_norm(o.to(h.dtype), z, w.norm, eps).reshape(S, nv * dv)  # [S, nv * dv]
    snapshots = LinearSteps(conv_inputs, torch.stack(steps)) if steps is not None else None
    return y, LinearState(conv_state, rec), snapshots


def empty_state(heads: LinearHeads, channels: int, kernel: int, device: torch.device,
                dtype: torch.dtype) -> LinearState:
    """A new sequence's state: zeros (conv in the model dtype, recurrent in state_dtype)."""
    return LinearState(torch.zeros(channels, kernel - 1, device=device, dtype=dtype),
                       torch.zeros(heads.n_v, heads.k_dim, heads.v_dim, device=device, dtype=state_dtype(dtype)))


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The recurrence runs and its state is kept in float32 (float64 for a float64 model)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
