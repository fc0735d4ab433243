"""Serving metrics: the periodic log line and the Prometheus exposition."""
