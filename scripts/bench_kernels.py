"""Kernel benchmarks: ragged paged attention (GPU body) against its peers.

Workloads (shared/PERFORMANCE.md): kernel-decode (64 sequences x 2048 context,
decode) and kernel-prefill (4 x 2048-token prompts), Llama-3-8B attention shape
(32 query / 8 KV heads, head_dim 128, bf16, page size 16). Beside the Pallas
kernel: the jnp reference, JAX's shipped `pallas.ops.gpu.paged_attention`
(decode) and `jax.nn.dot_product_attention` (dense causal prefill of the same
shape, cuDNN and XLA). HBM bandwidth and bf16 matmul peak are measured in the
same run; every time is reported against them.

Also: a correctness pass on the device (several configs against the reference
in float32) and the in-place KV update (write_kv under donation: HLO alias and
buffer pointer identity, and its time).

    PYTHONPATH=. python3 scripts/bench_kernels.py --out $OUT/kernels.json

Prints a short table last; writes everything as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.benchmarks.common import measure_hbm_bandwidth, measure_matmul_peak, median_time
from pallas_kernels.ragged_paged_attention import gpu, xla


def measure_ceilings() -> dict:
    return {"hbm_bytes_per_s": measure_hbm_bandwidth(), "bf16_flops_per_s": measure_matmul_peak()}


@dataclasses.dataclass
class Batch:
    q: jax.Array
    kv_ref: jax.Array  # reference layout [P, ps, 2H, D]
    kv: jax.Array  # kernel layout [P, 2H, ps, D]
    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array


def make_batch(seqs, *, num_kv_heads, group, head_dim, page_size, dtype, pad_tokens=0,
               pad_reqs=0, seed=0, want_ref_layout=True) -> Batch:
    rng = np.random.default_rng(seed)
    num_req = len(seqs) + pad_reqs
    need = [max(1, -(-kv // page_size)) for _, kv in seqs]
    width = max(need)
    num_pages = sum(need) + 1
    perm = rng.permutation(np.arange(1, num_pages))
    pi = np.zeros((num_req, width), np.int32)
    k = 0
    for r, n in enumerate(need):
        pi[r, :n] = perm[k:k + n]
        k += n
    cu = np.zeros(num_req + 1, np.int32)
    cu[1:len(seqs) + 1] = np.cumsum([q for q, _ in seqs])
    cu[len(seqs) + 1:] = cu[len(seqs)]
    kvl = np.zeros(num_req, np.int32)
    kvl[:len(seqs)] = [kv for _, kv in seqs]
    num_tokens = int(cu[-1]) + pad_tokens
    key = jax.random.key(seed)
    kq, kc = jax.random.split(key)
    q = jax.random.normal(kq, (num_tokens, num_kv_heads * group, head_dim), jnp.float32)
    kv = jax.random.normal(kc, (num_pages, 2 * num_kv_heads, page_size, head_dim), jnp.float32)
    kv = kv.astype(dtype)
    return Batch(q.astype(dtype), kv.transpose(0, 2, 1, 3) if want_ref_layout else None, kv,
                 jnp.asarray(kvl), jnp.asarray(pi), jnp.asarray(cu),
                 jnp.asarray([len(seqs)], jnp.int32))


def kernel_fn(bs=None, **kw):
    return jax.jit(lambda b: gpu.ragged_paged_attention(
        b.q, b.kv, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs, block_sizes=bs, **kw))


def reference_fn(**kw):
    return jax.jit(lambda b: xla.ragged_paged_attention(
        b.q, b.kv_ref, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs, **kw))


jax.tree_util.register_dataclass(
    Batch, data_fields=[f.name for f in dataclasses.fields(Batch)], meta_fields=[])


def correctness() -> list[dict]:
    rng = np.random.default_rng(1)
    configs = []
    for dtype in (jnp.bfloat16, jnp.float32):
        for group, head_dim, page_size, window, cap in (
                (1, 64, 16, None, None), (2, 128, 32, 50, None), (4, 128, 16, None, 30.0),
                (8, 256, 64, None, None), (4, 128, 128, 100, 20.0)):
            configs.append((dtype, group, head_dim, page_size, window, cap))
    results = []
    for dtype, group, head_dim, page_size, window, cap in configs:
        seqs = [(1, int(rng.integers(1, 600))) for _ in range(9)]
        seqs += [(q, q + int(rng.integers(0, 300))) for q in rng.integers(1, 300, 4)]
        seqs += [(page_size, 3 * page_size), (37, 37)]
        b = make_batch(seqs, num_kv_heads=2, group=group, head_dim=head_dim,
                       page_size=page_size, dtype=dtype, pad_tokens=5, pad_reqs=3,
                       seed=int(rng.integers(1 << 30)))
        kw = dict(sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
        b32 = dataclasses.replace(b, q=b.q.astype(jnp.float32),
                                  kv_ref=b.kv_ref.astype(jnp.float32))
        with jax.default_matmul_precision("highest"):
            ref = np.asarray(reference_fn(**kw)(b32))
        n_real = int(b.cu_q_lens[len(seqs)])
        for splits in (None, 4):
            name = (f"{jnp.dtype(dtype).name} G={group} D={head_dim} ps={page_size} "
                    f"win={window} cap={cap} splits={splits}")
            try:
                bs = None
                if splits:
                    bs = gpu.BlockSizes(max(1, 16 // group), 32, splits)
                out = np.asarray(kernel_fn(bs, **kw)(b).astype(jnp.float32))
                err = float(np.linalg.norm(out[:n_real] - ref[:n_real]) / np.linalg.norm(ref))
                pad_ok = bool(np.all(out[n_real:] == 0))
                finite = bool(np.isfinite(out).all())
                tol = 1e-4 if dtype == jnp.float32 else 2e-2
                ok = err < tol and pad_ok and finite
                results.append(dict(name=name, rel_err=err, pad_zero=pad_ok, finite=finite,
                                    ok=ok))
            except Exception as e:  # report and go on: the timing part still runs
                results.append(dict(name=name, ok=False, error=repr(e)[:2000]))
                traceback.print_exc()
            print("check", results[-1], flush=True)
    return results


def shipped_paged_attention_fn(**kw):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    return jax.jit(lambda q, k, v, bt, lens: paged_attention(q, k, v, bt, lens, **kw))


def decode_workload(ceil: dict, quick: bool) -> dict:
    seqs, ctx, hq, hkv, d, ps = 64, 2048, 32, 8, 128, 16
    b = make_batch([(1, ctx)] * seqs, num_kv_heads=hkv, group=hq // hkv, head_dim=d,
                   page_size=ps, dtype=jnp.bfloat16, seed=3)
    kw = dict(sm_scale=d**-0.5)
    kv_bytes = seqs * ctx * hkv * d * 2 * 2
    bytes_moved = kv_bytes + 2 * b.q.size * 2 + seqs * (ctx // ps) * 4
    res = {"shape": dict(seqs=seqs, ctx=ctx, hq=hq, hkv=hkv, head_dim=d, page_size=ps),
           "bytes": bytes_moved, "variants": {}}

    def record(name, fn, *args):
        try:
            t = median_time(fn, *args)
            gbs = bytes_moved / t
            res["variants"][name] = dict(us=t * 1e6, GBps=gbs / 1e9,
                                         frac_hbm=gbs / ceil["hbm_bytes_per_s"])
        except Exception as e:
            res["variants"][name] = dict(error=repr(e)[:2000])
            traceback.print_exc()
        print("decode", name, res["variants"][name], flush=True)

    ref_out = np.asarray(reference_fn(**kw)(b).astype(jnp.float32))
    out = np.asarray(kernel_fn(None, **kw)(b).astype(jnp.float32))
    res["kernel_rel_err"] = float(np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out))
    record("pallas_gpu default", kernel_fn(None, **kw), b)
    bs0 = gpu.default_block_sizes(b.q.shape[0], b.kv_lens.shape[0], hq // hkv, d, ps,
                                  b.page_indices.shape[1], hkv)
    items = gpu.work_items(b.cu_q_lens, b.num_seqs, b.q.shape[0], bs0.block_q)
    record("pallas_gpu default, work items precomputed (as shared by all layers)",
           jax.jit(lambda b, it: gpu.ragged_paged_attention(
               b.q, b.kv, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs, items=it, **kw)),
           b, items)
    variants = [(4, bkv, 1, nw, ns) for bkv in (16, 32) for ns in (3, 4, 6) for nw in (2, 4)]
    variants += [(4, 32, 2, 4, 4), (4, 16, 2, 4, 4), (4, 16, 2, 4, 6), (4, 64, 1, 2, 4),
                 (4, 64, 1, 4, 3), (4, 32, 1, 4, 8), (4, 16, 1, 4, 8)]
    variants = [v + (False,) for v in variants] + [(4, 32, 1, 4, 4, True), (4, 16, 1, 4, 6, True)]
    if quick:
        variants = variants[:3]
    for bq, bkv, sp, nw, ns, ev in variants:
        bs = gpu.BlockSizes(bq, bkv, sp, nw, ns, ev)
        record(f"pallas_gpu bq={bq} bkv={bkv} splits={sp} w={nw} s={ns}{' evict' if ev else ''}",
               kernel_fn(bs, **kw), b)
    record("jnp reference", reference_fn(**kw), b)

    # JAX's shipped paged attention: its own layout, K and V as separate
    # [Hkv, P, ps, D] arrays, converted outside the timed region.
    k_pages = jnp.asarray(b.kv[:, 0::2].transpose(1, 0, 2, 3))
    v_pages = jnp.asarray(b.kv[:, 1::2].transpose(1, 0, 2, 3))
    q = b.q
    peers = [dict(), dict(pages_per_compute_block=4, k_splits=16),
             dict(pages_per_compute_block=16, k_splits=8), dict(k_splits=8)]
    for pkw in peers[: 2 if quick else None]:
        record(f"jax paged_attention {pkw or 'defaults'}",
               shipped_paged_attention_fn(**pkw), q, k_pages, v_pages, b.page_indices, b.kv_lens)
    return res


def mgpu_kernel_fn(bs=None, **kw):
    from pallas_kernels.ragged_paged_attention import gpu_mgpu

    return jax.jit(lambda b: gpu_mgpu.ragged_paged_attention(
        b.q, b.kv, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs, block_sizes=bs, **kw))


def prefill_mgpu_variants(quick: bool) -> list:
    """(name, gpu_mgpu.BlockSizes) of the Mosaic GPU body; the 128-row Q tile is fixed."""
    from pallas_kernels.ragged_paged_attention import gpu_mgpu

    bs = gpu_mgpu.BlockSizes
    variants = [("pallas_mgpu default", None),
                ("pallas_mgpu persistent", bs(128, 2, True, True)),
                ("pallas_mgpu bkv=64 s=4", bs(64, 4, True, False)),
                ("pallas_mgpu no schedule barrier", bs(128, 2, False, False))]
    if not quick:
        variants += [("pallas_mgpu bkv=64 s=4 persistent", bs(64, 4, True, True)),
                     ("pallas_mgpu bkv=64 s=3", bs(64, 3, True, False)),
                     ("pallas_mgpu jax-default lowering semantics",
                      bs(128, 2, True, False, semantics=None))]
    return variants


def prefill_workload(ceil: dict, quick: bool) -> dict:
    seqs, length, hq, hkv, d, ps = 4, 2048, 32, 8, 128, 16
    b = make_batch([(length, length)] * seqs, num_kv_heads=hkv, group=hq // hkv, head_dim=d,
                   page_size=ps, dtype=jnp.bfloat16, seed=4)
    kw = dict(sm_scale=d**-0.5)
    flops = 4 * d * hq * seqs * (length * (length + 1) // 2)  # causal: visible pairs only
    res = {"shape": dict(seqs=seqs, len=length, hq=hq, hkv=hkv, head_dim=d, page_size=ps),
           "flops_causal": flops, "variants": {}}

    def record(name, fn, *args):
        try:
            t = median_time(fn, *args, iters=10, reps=5)
            fs = flops / t
            res["variants"][name] = dict(us=t * 1e6, TFLOPs=fs / 1e12,
                                         frac_peak=fs / ceil["bf16_flops_per_s"])
        except Exception as e:
            res["variants"][name] = dict(error=repr(e)[:2000])
            traceback.print_exc()
        print("prefill", name, res["variants"][name], flush=True)

    ref_out = np.asarray(reference_fn(**kw)(b).astype(jnp.float32))
    out = np.asarray(kernel_fn(None, **kw)(b).astype(jnp.float32))
    res["kernel_rel_err"] = float(np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out))
    # Mosaic GPU (Hopper) body: error against the same reference, then timed below.
    mgpu_variants = prefill_mgpu_variants(quick)
    res["mgpu_rel_err"] = {}
    for name, bs in mgpu_variants:
        try:
            out = np.asarray(mgpu_kernel_fn(bs, **kw)(b).astype(jnp.float32))
            res["mgpu_rel_err"][name] = float(np.linalg.norm(out - ref_out)
                                              / np.linalg.norm(ref_out))
        except Exception as e:  # recorded, not fatal: the other variants still run
            res["mgpu_rel_err"][name] = repr(e)[:2000]
            traceback.print_exc()
        print("prefill rel_err", name, res["mgpu_rel_err"][name], flush=True)
    del ref_out, out
    record("pallas_gpu default", kernel_fn(None, **kw), b)
    for name, bs in mgpu_variants:
        if isinstance(res["mgpu_rel_err"][name], float):
            record(name, mgpu_kernel_fn(bs, **kw), b)
        else:
            res["variants"][name] = dict(error=res["mgpu_rel_err"][name])
    variants = [(32, 128, 8, 2), (32, 128, 8, 3), (32, 128, 8, 4), (32, 128, 4, 3),
                (64, 128, 8, 3), (64, 64, 8, 3), (16, 128, 4, 3), (32, 64, 8, 3)]
    if quick:
        variants = variants[:3]
    for bq, bkv, nw, ns in variants:
        bs = gpu.BlockSizes(bq, bkv, 1, nw, ns)
        record(f"pallas_gpu bq={bq}x{hq // hkv} bkv={bkv} w={nw} s={ns}", kernel_fn(bs, **kw), b)
    record("jnp reference", reference_fn(**kw), b)

    qd = b.q.reshape(seqs, length, hq, d)
    kd = jax.random.normal(jax.random.key(5), (seqs, length, hkv, d), jnp.bfloat16)
    vd = jax.random.normal(jax.random.key(6), (seqs, length, hkv, d), jnp.bfloat16)
    for impl in ("cudnn", "xla"):
        fn = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, scale=d**-0.5, implementation=impl))
        record(f"jax.nn.dot_product_attention {impl}", fn, qd, kd, vd)
    return res


def _write_kv_general(kv_cache, k, v, slot_mapping):
    """The general form: 3-index scatter of [T, 2H, D] updates, duplicates allowed
    (what gpu.write_kv replaced)."""
    _, two_h, page_size, _ = kv_cache.shape
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], two_h, k.shape[-1])
    page = (slot_mapping // page_size)[:, None]
    off = (slot_mapping % page_size)[:, None]
    head = jnp.arange(two_h, dtype=slot_mapping.dtype)[None, :]
    return kv_cache.at[page, head, off].set(kv.astype(kv_cache.dtype), mode="drop")


KV_UPDATE_PAGES = 8193


def kv_update() -> dict:
    """write_kv under donation: in place (alias in HLO, same buffer) and its time.

    Timed as 16 writes inside one jit (as in the model step, where it runs once
    per layer), so host dispatch is not counted."""
    res = {}
    hkv, d, ps, num_pages, reps = 8, 128, 16, KV_UPDATE_PAGES, 16
    cache = jnp.zeros((num_pages, 2 * hkv, ps, d), jnp.bfloat16)
    for name, fn in (("general scatter", _write_kv_general), ("gpu.write_kv", gpu.write_kv)):
        def many(cache, k, v, slots, fn=fn):
            return jax.lax.fori_loop(0, reps, lambda i, c: fn(c, k + i, v, slots), cache)

        step = jax.jit(many, donate_argnums=0)
        for tokens in (64, 8192):
            k = jax.random.normal(jax.random.key(tokens), (tokens, hkv, d), jnp.bfloat16)
            v = -k
            slots = jnp.asarray(np.random.default_rng(0).permutation(num_pages * ps)[:tokens],
                                jnp.int32)
            hlo = step.lower(cache, k, v, slots).compile().as_text()
            before = cache.unsafe_buffer_pointer()
            cache = step(cache, k, v, slots)
            same = cache.unsafe_buffer_pointer() == before
            jax.block_until_ready(cache)
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                cache = step(cache, k, v, slots)
                jax.block_until_ready(cache)
                ts.append((time.perf_counter() - t0) / reps)
            key = f"{name} tokens={tokens}"
            res[key] = dict(us=statistics.median(ts) * 1e6, same_buffer=bool(same),
                            hlo_alias="input_output_alias" in hlo)
            print("kv_update", key, res[key], flush=True)
    return res


def compile_only() -> None:
    """Compiles the two workload kernels once (for --xla_dump_to PTX inspection)."""
    for seqs in ([(1, 2048)] * 64, [(2048, 2048)] * 4):
        b = make_batch(seqs, num_kv_heads=8, group=4, head_dim=128, page_size=16,
                       dtype=jnp.bfloat16, want_ref_layout=False)
        jax.block_until_ready(kernel_fn(None, sm_scale=0.1)(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="kernels.json")
    ap.add_argument("--quick", action="store_true", help="fewer variants")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--only", choices=["decode", "prefill"], default=None)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--commit", default=None, help="recorded as is (no .git on the device)")
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
        return

    dev = jax.devices()[0]
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"],
                                         text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        commit = "unknown"
    commit = args.commit or commit
    out = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
           "date": time.strftime("%Y-%m-%d"), "commit": commit, "argv": sys.argv}
    print(out, flush=True)
    out["ceilings"] = ceil = measure_ceilings()
    print("ceilings", ceil, flush=True)
    if not args.skip_correctness:
        out["correctness"] = correctness()
    if args.only in (None, "decode"):
        out["decode"] = decode_workload(ceil, args.quick)
    if args.only in (None, "prefill"):
        out["prefill"] = prefill_workload(ceil, args.quick)
    out["kv_update"] = kv_update()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)

    print(f"\n== {out['device']} jax {out['jax']} commit {commit}")
    print(f"HBM {ceil['hbm_bytes_per_s'] / 1e12:.2f} TB/s   "
          f"bf16 matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s")
    if "correctness" in out:
        bad = [r["name"] for r in out["correctness"] if not r["ok"]]
        worst = max((r.get("rel_err", math.inf) for r in out["correctness"]), default=0)
        print(f"correctness: {len(out['correctness']) - len(bad)}/{len(out['correctness'])} ok,"
              f" worst rel err {worst:.2e}; failing: {bad}")
    for wl, key in (("decode", "frac_hbm"), ("prefill", "frac_peak")):
        if wl not in out:
            continue
        print(f"-- {wl} (kernel rel err {out[wl]['kernel_rel_err']:.1e})")
        for name, v in out[wl]["variants"].items():
            if "error" in v:
                print(f"  {name:58s} ERROR")
            else:
                print(f"  {name:58s} {v['us']:9.1f} us  {v[key]:6.1%}")
    for k, v in out["kv_update"].items():
        print(f"kv_update {k}: {v['us']:.1f} us in_place={v['same_buffer']} "
              f"alias={v['hlo_alias']}")


if __name__ == "__main__":
    main()
