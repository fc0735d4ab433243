"""grid-barrier: what one grid-wide barrier costs inside a Pallas GPU (Triton) kernel.

A kernel that spans a layer's dependent steps (one persistent program per SM instead of a
kernel per step) must wait between steps for every program: an atomic add on a counter in
global memory, then a spin on atomic reads until the counter reaches the round's target.
This times a kernel of `--rounds` such barriers against one of none, over `--programs`
programs (default: one per SM, all resident at once), and reports the difference per
barrier. The call without barriers may be bound by the host's dispatch rather than the
GPU, so the difference is a lower bound; `at most` adds that whole call's time spread
over the rounds. Set them against the ~1.4 us floor of the small kernels such a kernel
would replace (BENCHMARKS.md, Qwen3-30B-A3B decode).

    PYTHONPATH=. python3 scripts/bench_grid_barrier.py --out $OUT/grid_barrier.json
    PYTHONPATH=. python3 scripts/bench_grid_barrier.py --small   # CPU dry run, one program

The dry run interprets the kernel; interpret mode runs programs one after another, so more
than one program would spin forever there.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxllm.benchmarks.common import median_time
from pallas_kernels.triton_util import compiler_params


def _barriers_kernel(_count_in, count_ref, *, rounds: int, programs: int):
    # Arrays, not Python ints: interpret mode's atomics take no weakly typed scalars.
    at, one, zero = jnp.int32(0), jnp.int32(1), jnp.int32(0)

    def barrier(r, carry):
        plt.atomic_add(count_ref, at, one)
        target = (r + 1) * programs
        lax.while_loop(lambda seen: seen < target,
                       lambda _: plt.atomic_add(count_ref, at, zero),  # an atomic read
                       plt.atomic_add(count_ref, at, zero))
        return carry

    lax.fori_loop(0, rounds, barrier, 0)


def barriers(rounds: int, programs: int, interpret: bool = False):
    """A jitted call running `rounds` grid barriers over `programs` programs; returns
    the counter, `rounds * programs` when every program passed every barrier."""
    call = pl.pallas_call(
        functools.partial(_barriers_kernel, rounds=rounds, programs=programs),
        out_shape=jax.ShapeDtypeStruct((1,), jnp.int32), grid=(programs,),
        input_output_aliases={0: 0}, compiler_params=compiler_params(1, 1),
        interpret=interpret, name="grid_barriers")
    return jax.jit(lambda: call(jnp.zeros((1,), jnp.int32)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--programs", type=int, nargs="+",
                   help="programs in the grid (default: the GPU's SMs, and twice that)")
    p.add_argument("--rounds", type=int, default=256)
    p.add_argument("--small", action="store_true",
                   help="CPU dry run: interpret mode, one program, few rounds")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    if args.small:
        programs, rounds, iters, reps = [1], min(args.rounds, 4), 2, 2
    else:
        sms = jax.devices()[0].core_count
        programs, rounds, iters, reps = args.programs or [sms, 2 * sms], args.rounds, 20, 7
    rows = []
    for n in programs:
        none, some = barriers(0, n, args.small), barriers(rounds, n, args.small)
        count = int(some()[0])
        if count != rounds * n:
            raise SystemExit(f"the counter read {count}, not {rounds} x {n}: a barrier broke")
        t_none = median_time(none, iters=iters, reps=reps)
        t_some = median_time(some, iters=iters, reps=reps)
        per = (t_some - t_none) / rounds
        rows.append(dict(programs=n, rounds=rounds, kernel_us=t_none * 1e6,
                         per_barrier_us=per * 1e6,
                         per_barrier_at_most_us=(per + t_none / rounds) * 1e6))
    result = dict(device=jax.devices()[0].device_kind, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(f"{'programs':>9} {'rounds':>7} {'no-barrier call us':>19} {'us a barrier':>13} "
          f"{'at most':>8}")
    for r in rows:
        print(f"{r['programs']:>9} {r['rounds']:>7} {r['kernel_us']:>19.2f} "
              f"{r['per_barrier_us']:>13.3f} {r['per_barrier_at_most_us']:>8.3f}")


if __name__ == "__main__":
    main()
