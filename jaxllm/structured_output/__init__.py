"""Structured output: grammars (llguidance) that constrain what a request may generate."""
