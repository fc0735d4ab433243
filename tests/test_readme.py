"""Every snippet of README.md runs as written and prints the answers its comments give.

A Python line `print(...)   # " 10 11 12 13 14"` promises that output line (the comment is a
Python literal; a string prints without its quotes). The offline snippet runs in a fresh
interpreter; the server snippets (curl and the openai client) against `jaxllm serve` with the
demo model, whose address replaces the README's 127.0.0.1:8000 (tests bind a free port). The
Quickstart's `jaxllm generate` line runs too.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from jaxllm import demo_tasks
from tests.entrypoints.server import TINY_ENGINE_FLAGS, RemoteServer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
README_URL = "http://127.0.0.1:8000"

pytestmark = pytest.mark.slow  # engines and a server start here


def snippets(language: str) -> list[str]:
    with open(README) as f:
        text = f.read()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def promised_output(code: str) -> list[str]:
    """The lines the snippet's print calls promise, in source order."""
    lines = code.splitlines()
    out = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                and getattr(node.value.func, "id", None) == "print":
            last = lines[node.end_lineno - 1]
            assert "#" in last, f"print without its answer in a comment: {last!r}"
            value = ast.literal_eval(last.rsplit("#", 1)[1].strip())
            out.append((node.lineno, value if isinstance(value, str) else repr(value)))
    return [v for _, v in sorted(out)]


def run_python(code: str) -> list[str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.splitlines()


def test_the_readme_has_the_snippets_this_test_runs():
    python = snippets("python")
    assert len(python) == 3  # the offline API, embeddings and the openai client
    assert all(promised_output(code) for code in python)
    assert any("curl" in code for code in snippets("bash"))


def test_the_offline_api_snippet_prints_its_answers():
    (code,) = [c for c in snippets("python") if "from jaxllm import" in c]
    want = promised_output(code)
    assert want[:3] == [demo_tasks.expected_answer(p)
                        for p in ("reverse jaxllm", "count 7 8 9", "sort 3 1 2")]
    assert run_python(code) == want


def test_the_embeddings_snippet_prints_its_answers():
    """Run on all-MiniLM-L6-v2 (the test extra installs it), one token bucket."""
    from tests.models.minilm import minilm_dir

    (code,) = [c for c in snippets("python") if "jaxllm.LLM(" in c]
    want = promised_output(code)
    assert want[0] == "384"
    code = code.replace('"/path/to/all-MiniLM-L6-v2"', f"{minilm_dir()!r}, token_buckets="
                        "[256], max_num_batched_tokens=256")
    assert run_python(code) == want


def test_the_quickstart_generate_command_answers_each_prompt():
    (command,) = [c for c in snippets("bash") if "jaxllm generate" in c]
    args = shlex.split(command.split("&&")[-1])
    assert args[:2] == ["jaxllm", "generate"]
    proc = subprocess.run([sys.executable, "-m", "jaxllm.entrypoints.cli", *args[1:]],
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = [f"{p!r} -> {demo_tasks.expected_answer(p)!r}" for p in args[2:]]
    assert proc.stdout.splitlines() == want


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(["--config", "configs/server-demo.yaml", *TINY_ENGINE_FLAGS,
                        "--max-num-seqs", "4", "--request-buckets", "4"])
    yield srv
    srv.stop()


def test_the_curl_snippet_answers_the_chat_request(server):
    (block,) = [c for c in snippets("bash") if "curl" in c]
    command = block.replace(README_URL, server.url).replace("\\\n", " ")
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)["choices"][0]["message"]["content"]
    assert answer == demo_tasks.expected_answer("sort 4 2 3")


def test_the_openai_client_snippet_prints_its_answers(server):
    (code,) = [c for c in snippets("python") if "from openai import" in c]
    assert README_URL in code
    want = promised_output(code)
    assert want == [demo_tasks.expected_answer("reverse abc"),
                    demo_tasks.expected_answer("reverse hello"), "128",
                    "get_weather"]  # the named tool_choice's call
    assert run_python(code.replace(README_URL, server.url)) == want
