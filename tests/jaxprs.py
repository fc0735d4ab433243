"""Walking a traced program's equations, nested programs included (for tests that
count what a step's program holds)."""

from __future__ import annotations

from collections.abc import Iterator

import jax.extend.core


def equations(jaxpr, kernels: bool = True) -> Iterator:
    """Every equation of `jaxpr` and of the programs nested in its equations; a Pallas
    kernel's body too unless `kernels` is False."""
    for eqn in jaxpr.eqns:
        yield eqn
        if kernels or eqn.primitive.name != "pallas_call":
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from equations(sub, kernels)
