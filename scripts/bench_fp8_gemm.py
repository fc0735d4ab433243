"""fp8-gemm: bf16, FP8 W8A8 and FP8 weight-only products of the Llama-3-8B projections
at each row count, against their rooflines. The benchmark lives in
jaxllm/benchmarks/fp8_gemm.py."""

from jaxllm.benchmarks.fp8_gemm import main

if __name__ == "__main__":
    main()
