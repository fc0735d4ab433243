"""decode-1: batch 1, prompt 128, 256 new tokens on the Llama-3-8B shape; ms/token vs roofline.

The benchmark lives in jaxllm/benchmarks/latency.py; `jaxllm bench latency` runs the same.
"""

from jaxllm.benchmarks.latency import main

if __name__ == "__main__":
    main()
