"""Frozen, self-validating specs: Topology, ModelSpec, Suite."""
