"""Disaggregated prefill/decode: the prefill world, the KV store, the decode side's connector, moved state."""
