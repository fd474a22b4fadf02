"""Speculative decoding: speculators (draft, MTP), their weights, draft + verify."""
