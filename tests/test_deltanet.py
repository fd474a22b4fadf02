"""Gated DeltaNet (harness/engine/layers/deltanet.py) against naive per-head, per-token loops."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from harness.engine.layers.deltanet import (
    LinearHeads,
    LinearWeights,
    causal_conv,
    delta_rule,
    empty_state,
    linear_attention,
)


def naive_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Element by element: S <- e^g S; S[i, j] += k[i] * beta * (v[j] - sum_i' S[i', j] k[i']);
    o[j] = sum_i S[i, j] q[i]."""
    S, H, dk = q.shape
    dv = v.shape[-1]
    st = state.clone().double()
    out = torch.zeros(S, H, dv, dtype=torch.float64)
    for t in range(S):
        for h in range(H):
            decay = math.exp(float(g[t, h]))
            for i in range(dk):
                for j in range(dv):
                    st[h, i, j] *= decay
            mem = [sum(float(st[h, i, j]) * float(k[t, h, i]) for i in range(dk)) for j in range(dv)]
            for i in range(dk):
                for j in range(dv):
                    st[h, i, j] += float(k[t, h, i]) * float(beta[t, h]) * (float(v[t, h, j]) - mem[j])
            for j in range(dv):
                out[t, h, j] = sum(float(st[h, i, j]) * float(q[t, h, i]) for i in range(dk))
    return out, st


def test_delta_rule_equals_the_naive_recurrence() -> None:
    gen = torch.Generator().manual_seed(3)
    S, H, dk, dv = 5, 3, 4, 3
    q = torch.randn(S, H, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(S, H, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(S, H, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(S, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(S, H, generator=gen, dtype=torch.float64)
    state = torch.randn(H, dk, dv, generator=gen, dtype=torch.float64)
    got_o, got_s = delta_rule(q, k, v, g, beta, state)
    want_o, want_s = naive_delta(q, k, v, g, beta, state)
    torch.testing.assert_close(got_o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_s, want_s, rtol=1e-12, atol=1e-12)
    # a masked token leaves the state alone: the same as leaving it out
    mask = torch.tensor([True, True, False, True, True])
    _, masked = delta_rule(q, k, v, g, beta, state, mask)
    keep = mask.nonzero().flatten()
    _, without = naive_delta(q[keep], k[keep], v[keep], g[keep], beta[keep], state)
    torch.testing.assert_close(masked, without, rtol=1e-12, atol=1e-12)


def test_causal_conv_equals_conv1d_and_carries_its_state() -> None:
    gen = torch.Generator().manual_seed(4)
    S, C, K = 7, 5, 4
    x = torch.randn(S, C, generator=gen, dtype=torch.float64)
    w = torch.randn(C, K, generator=gen, dtype=torch.float64)
    zero = torch.zeros(C, K - 1, dtype=torch.float64)
    got, _, _ = causal_conv(x, w, zero)
    # [S, C] -> [1, C, S], left-padded by K - 1, depthwise
    want = F.silu(F.conv1d(F.pad(x.T[None], (K - 1, 0)), w[:, None, :], groups=C)[0].T)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # split into a 4-token prefill and 3 decode steps: the same outputs
    first, state, _ = causal_conv(x[:4], w, zero)
    rest = []
    for t in range(4, S):
        y, state, _ = causal_conv(x[t:t + 1], w, state)
        rest.append(y)
    torch.testing.assert_close(torch.cat([first, *rest]), want, rtol=1e-12, atol=1e-12)
    # right padding after `length` tokens does not enter the state
    _, padded_state, _ = causal_conv(torch.cat([x[:4], torch.randn(2, C, generator=gen, dtype=torch.float64)]), w,
                                  zero, length=4)
    _, exact_state, _ = causal_conv(x[:4], w, zero)
    torch.testing.assert_close(padded_state, exact_state)


def test_layer_prefill_equals_token_by_token_decode() -> None:
    gen = torch.Generator().manual_seed(5)
    H, nk, nv, dk, dv, K, S = 16, 2, 4, 4, 3, 4, 6
    C = 2 * nk * dk + nv * dv
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.3  # noqa: E731
    w = LinearWeights(attn_norm=torch.ones(H), qkv=r(C, H), z=r(nv * dv, H), b=r(nv, H), a=r(nv, H), conv=r(C, K),
                      a_log=r(nv), dt_bias=r(nv), norm=1 + r(dv), out=r(H, nv * dv))
    heads = LinearHeads(n_k=nk, n_v=nv, k_dim=dk, v_dim=dv, v_to_local_k=(0, 0, 1, 1))
    h = r(S, H)
    start = empty_state(heads, C, K, torch.device("cpu"), torch.float64)
    # [S, nv * dv]: the output before the out projection
    whole, end, snapshots = linear_attention(h, w, heads, start, 1e-6, length=S, keep_steps=True)
    assert snapshots is not None
    state, outs = start, []
    for t in range(S):
        y, state, _ = linear_attention(h[t:t + 1], w, heads, state, 1e-6, length=1)
        after = snapshots.after(t + 1, K)  # the snapshot after t + 1 tokens is the token-by-token state
        torch.testing.assert_close(after.recurrent, state.recurrent, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(after.conv, state.conv)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state.recurrent, end.recurrent, rtol=1e-10, atol=1e-10)
    assert state.recurrent.dtype == torch.float64  # a float64 model keeps a float64 state
