"""Compare a parallel run with the reference: pure functions from run artifacts to verdicts. Import
each submodule by its own name (harness.compare.parity.logits, ...): this package re-exports nothing, so a light
submodule (e.g. harness.compare.settings) imports no torch."""
