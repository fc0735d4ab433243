#!/usr/bin/env bash
# Issue 32's several-GPU workloads, all with random (dummy) bf16 weights. Run from the
# repository root on an 8-GPU host; each step fits one 10-minute device command:
#     scripts/run_multi_gpu.sh list          # the steps
#     scripts/run_multi_gpu.sh 8b-decode-tp2 # one step
#     scripts/run_multi_gpu.sh all           # every step in turn
# Each step writes its JSON under $OUT (default results/multi_gpu/<step>/) and prints
# its table; BENCHMARKS.md's "several GPUs" section lists what each step must show.
# The tp 1 baselines run on the same machine, so the ratios compare like with like.
set -euo pipefail

export NCCL_NVLS_ENABLE=0   # NVLink multicast stays off on the lent machines
export JAXLLM_COMMIT="${JAXLLM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
PY="${PYTHON:-python3}"
ROOT="${OUT:-results/multi_gpu}"
B8="--model configs/llama-3-8b --load-format dummy --dtype bfloat16"
B70="--model configs/llama-3-70b --load-format dummy --dtype bfloat16"
NOPEER=(--hf-peer-batch-sizes "")  # the transformers peer is a one-GPU figure

lat() { PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PY" scripts/bench_latency.py "$@"; }
thr() { PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PY" scripts/bench_throughput.py "${NOPEER[@]}" "$@"; }
srv() { PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PY" scripts/bench_serving.py "$@"; }

STEPS=(8b-decode-tp1 8b-decode-tp2 8b-decode-tp4 8b-decode-tp2-workers 8b-decode-tp4-workers
       8b-throughput-tp1 8b-throughput-tp2 8b-throughput-tp4 8b-throughput-dp2
       70b-decode-tp4 70b-decode-tp8 70b-throughput-tp4 70b-throughput-tp8
       8b-serving-tp2)

step() {
  local out="$ROOT/$1"
  mkdir -p "$out"
  echo "=== $1 ($(date -u +%H:%M:%S))"
  case "$1" in
    8b-decode-tp1)     OUT="$out" lat $B8 --tensor-parallel-size 1 ;;
    8b-decode-tp2)     OUT="$out" lat $B8 --tensor-parallel-size 2 ;;
    8b-decode-tp4)     OUT="$out" lat $B8 --tensor-parallel-size 4 ;;
    # The same with one process per GPU (benchmarks/workers.py), each launching its own.
    8b-decode-tp2-workers) OUT="$out" lat $B8 --tensor-parallel-size 2 --worker-processes ;;
    8b-decode-tp4-workers) OUT="$out" lat $B8 --tensor-parallel-size 4 --worker-processes ;;
    8b-throughput-tp1) OUT="$out" thr $B8 --tensor-parallel-size 1 ;;
    # tp 2's KV cache holds every request, so all 1000 decode together (vLLM's offline
    # default on these GPUs); one GPU's holds about two thirds, and is fastest at 512.
    8b-throughput-tp2) OUT="$out" thr $B8 --tensor-parallel-size 2 --max-num-seqs 1024 \
                         --request-buckets 64,512,1024 ;;
    8b-throughput-tp4) OUT="$out" thr $B8 --tensor-parallel-size 4 ;;
    # Two benchmark replicas on GPUs 0 and 1, 500 requests each (benchmarks/replicas.py).
    8b-throughput-dp2) OUT="$out" thr $B8 --tensor-parallel-size 1 --data-parallel-size 2 ;;
    # 70B at tp 4 holds 35 GB of weights a GPU; at the default pool fraction (0.95) XLA
    # could not allocate its collective memory outside the pool while precompiling.
    70b-decode-tp4)    OUT="$out" XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 lat $B70 --tensor-parallel-size 4 ;;
    70b-decode-tp8)    OUT="$out" lat $B70 --tensor-parallel-size 8 ;;
    70b-throughput-tp4) OUT="$out" XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 thr $B70 --tensor-parallel-size 4 ;;
    70b-throughput-tp8) OUT="$out" thr $B70 --tensor-parallel-size 8 ;;
    # A fixed rate on a tp-2 server (the one-GPU serving table's 4/s and 16/s).
    8b-serving-tp2)
      OUT="$out" srv --server-args \
        "--config configs/server-llama-3-8b-dummy.yaml --tensor-parallel-size 2" \
        --vocab-size 128256 --request-rates 4,16 --num-prompts 50 ;;
    *) echo "unknown step '$1'; one of: ${STEPS[*]} all list" >&2; exit 2 ;;
  esac
}

case "${1:-list}" in
  list) printf '%s\n' "${STEPS[@]}" ;;
  all) for s in "${STEPS[@]}"; do step "$s"; done ;;
  *) for s in "$@"; do step "$s"; done ;;
esac
