"""Faults in multi-head latent attention (mla.py): each reproduces one real bug of this code behind a flag
(harness/engine/fault.py); the catalog (harness/engine/faults.py) gathers them."""

from __future__ import annotations

from harness.engine.fault import Fault

FAULTS: tuple[Fault, ...] = (
    Fault("mla-rope-local-slot", "logits",
          "under DCP the MLA latent's decoupled RoPE key rotated by the token's slot in its owner's local "
          "latent cache instead of its global position (queries keep global positions)", needs_dcp=True,
          flags={"latent_rope_local_slot": True}),
    Fault("q-replicated-own-slice", "layout, logits",
          "Q-replicated DCP loading only the rank's own slice of q_b_proj / w_kc for every head of its DCP "
          "group, so the other heads' queries are computed with the wrong weights", needs_dcp=True,
          needs_q_replicated=True,
          flags={"q_own_slice": True}),
)
