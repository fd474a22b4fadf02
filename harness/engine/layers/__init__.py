"""The torch code of each architecture feature: dense attention and MLP, MLA, sparse
attention, Gated DeltaNet, MoE, attention DP."""
