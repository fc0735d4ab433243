"""prefix: TTFT with a shared 1024-token prefix cached against the same work uncached.

The benchmark lives in jaxllm/benchmarks/prefix.py; `jaxllm bench prefix` runs the same.
"""

from jaxllm.benchmarks.prefix import main

if __name__ == "__main__":
    main()
