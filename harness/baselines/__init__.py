"""Stored expected scores (GSM8K and acceptance) in one store with one provenance rule, and their gates."""
