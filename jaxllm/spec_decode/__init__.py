"""Speculative decoding: its config and the host-side draft proposers (ngram prompt lookup;
a draft model runs on the device: worker/draft_model.py)."""
