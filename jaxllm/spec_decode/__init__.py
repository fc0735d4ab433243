"""Speculative decoding: draft proposers (ngram prompt lookup)."""
