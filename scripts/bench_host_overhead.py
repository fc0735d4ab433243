"""host-overhead: one engine step's host time with the device work stubbed out.

The benchmark lives in jaxllm/benchmarks/host_overhead.py;
`jaxllm bench host-overhead` runs the same.
"""

from jaxllm.benchmarks.host_overhead import main

if __name__ == "__main__":
    main()
