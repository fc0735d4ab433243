"""spec-verify: verify steps of k + 1 tokens per request against a decode step, and the
demo model's ngram acceptance. The benchmark lives in jaxllm/benchmarks/spec.py."""

from jaxllm.benchmarks.spec import main

if __name__ == "__main__":
    main()
