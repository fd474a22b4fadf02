"""Top-k logits metrics: the KL lower bound never exceeds the full KL, and the checks grade runs."""

from __future__ import annotations

import torch

from harness.compare.parity.topk import topk_metrics


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    top = lp.topk(k, dim=-1)
    return top.indices, top.values


def test_kl_lower_bound_is_below_the_full_kl_and_zero_for_identical_runs() -> None:
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 50, generator=gen, dtype=torch.float64) * 3
    for scale in (0.0, 0.01, 0.3, 2.0):
        par = ref + scale * torch.randn(64, 50, generator=gen, dtype=torch.float64)
        full = (torch.log_softmax(ref, -1).exp() * (torch.log_softmax(ref, -1) - torch.log_softmax(par, -1))).sum(-1)
        m = topk_metrics(*_topk(ref, 8), *_topk(par, 8))
        assert bool((m.kl_lower <= full + 1e-12).all())
        if scale == 0.0:
            assert float(m.kl_lower.max()) < 1e-12 and float(m.lp_error.max()) == 0.0
            assert bool(m.top1_match.all()) and float(m.overlap.min()) == 1.0
        if scale == 2.0:
            assert float(m.kl_lower.mean()) > 0.1 * float(full.mean())  # the bound still sees a real divergence


def test_flip_outside_the_reference_top_k_has_at_least_the_top_k_spread() -> None:
    ref = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0]])
    par = torch.tensor([[0.0, 0.0, 0.0, 0.0, 9.0]])  # its top-1 (token 4) is outside the reference top-2
    m = topk_metrics(*_topk(ref, 2), *_topk(par, 2))
    assert not bool(m.top1_match[0])
    assert abs(float(m.flip_gap[0]) - 1.0) < 1e-9  # ref top-1 minus ref k-th logprob (5 - 4)
    tie = torch.tensor([[5.0, 5.0 - 1e-6, 0.0]])
    swapped = torch.tensor([[5.0 - 1e-6, 5.0, 0.0]])
    m = topk_metrics(*_topk(tie, 2), *_topk(swapped, 2))
    assert float(m.flip_gap[0]) < 1e-5 and float(m.overlap[0]) == 1.0
