"""grouped-matmul: the mixture-of-experts grouped matmul bodies on the Qwen3-30B-A3B expert
shapes against each other and their rooflines. The benchmark lives in
jaxllm/benchmarks/grouped_matmul.py."""

from jaxllm.benchmarks.grouped_matmul import main

if __name__ == "__main__":
    main()
