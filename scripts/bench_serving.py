"""serving: Poisson arrivals at several request rates against the OpenAI server.

The benchmark lives in jaxllm/benchmarks/serving.py; `jaxllm bench serving` runs the same.
"""

from jaxllm.benchmarks.serving import main

if __name__ == "__main__":
    main()
