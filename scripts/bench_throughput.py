"""throughput: 1000 requests x (512 random prompt tokens, 128 new), all submitted at once.

The benchmark lives in jaxllm/benchmarks/throughput.py; `jaxllm bench throughput` runs the same.
"""

from jaxllm.benchmarks.throughput import main

if __name__ == "__main__":
    main()
