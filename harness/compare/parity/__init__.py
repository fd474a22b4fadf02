"""Parity of outputs: logits, top-k, generations, jumps, noise, schedules, localization."""
