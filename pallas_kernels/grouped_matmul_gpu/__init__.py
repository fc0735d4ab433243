"""The mixture-of-experts grouped matmul as a Pallas GPU (Triton) kernel, `gpu.py`, with its
plain jnp oracle, `reference.py`."""
