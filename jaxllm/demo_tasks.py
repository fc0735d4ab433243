"""The embedded demo model's three synthetic tasks: prompts, exact answers, held-out split.

The demo checkpoint (jaxllm/assets/demo-model) is trained by scripts/train_demo_model.py on
prompts drawn here, and the tests and the CLI check its answers against `expected_answer`.

  count 17 18 19   ->  " 20 21 22 23 24"   (1-4 numbers given, always 5 more, all <= 999)
  reverse abcdef   ->  " fedcba"           (3-12 lowercase letters)
  sort 5 9 1 7     ->  " 1 5 7 9"          (2-8 digits, duplicates kept)

An answer starts with a space, so prompt + answer reads as one line. The model answers a
prompt in either of two formats: as a chat turn (`chat`, the checkpoint's chat template), or
as a raw completion of `<s>` + prompt, where it first writes RAW_ANSWER_MARKER, a special token
that decoded text skips, to mark where the prompt ended (a raw `count 1 2 3 4 5 6 7` is
otherwise ambiguous), then the answer and `</s>`. About a tenth of all
prompts are held out by a hash of the prompt text: training never sees them, so
`heldout_prompts` measures generalisation, not recall.
"""

from __future__ import annotations

import hashlib
import random
import string

TASKS: tuple[str, ...] = ("count", "reverse", "sort")
COUNT_CONTINUATION = 5  # numbers the model appends to a counting prompt
COUNT_MAX = 999
COUNT_GIVEN = (1, 4)  # how many numbers a counting prompt shows
REVERSE_LEN = (3, 12)
SORT_LEN = (2, 8)
HELDOUT_PERCENT = 10
RAW_ANSWER_MARKER = "<|assistant|>"  # the first token of a raw completion's answer


def is_heldout(prompt: str) -> bool:
    """Whether a prompt belongs to the held-out split (a fixed hash, so stable across runs)."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELDOUT_PERCENT


def _sample(task: str, rng: random.Random) -> str:
    if task == "count":
        given = rng.randint(*COUNT_GIVEN)
        # Draw the digit count first so that the carries 9->10 and 99->100 are common.
        digits = rng.randint(1, 3)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        high = min(10**digits - 1, COUNT_MAX - given - COUNT_CONTINUATION + 1)
        start = rng.randint(low, high)
        return "count " + " ".join(str(start + i) for i in range(given))
    if task == "reverse":
        n = rng.randint(*REVERSE_LEN)
        return "reverse " + "".join(rng.choice(string.ascii_lowercase) for _ in range(n))
    if task == "sort":
        n = rng.randint(*SORT_LEN)
        return "sort " + " ".join(rng.choice(string.digits) for _ in range(n))
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def make_prompt(task: str, rng: random.Random, split: str = "train") -> str:
    """A random prompt of `task` from `split` ('train' or 'heldout')."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    want_heldout = split == "heldout"
    while True:
        prompt = _sample(task, rng)
        if is_heldout(prompt) == want_heldout:
            return prompt


def heldout_prompts(task: str, n: int, seed: int = 0) -> list[str]:
    """`n` distinct held-out prompts of `task`, the same for the same seed."""
    rng = random.Random(f"heldout-{task}-{seed}")
    seen: dict[str, None] = {}
    for _ in range(200 * n):
        seen.setdefault(make_prompt(task, rng, "heldout"))
        if len(seen) == n:
            return list(seen)
    raise ValueError(f"task {task!r} has fewer than {n} distinct held-out prompts")


def task_of(prompt: str) -> str:
    """The task a prompt asks for (its first word)."""
    task = prompt.split(" ", 1)[0]
    if task not in TASKS:
        raise ValueError(f"not a demo prompt: {prompt!r}")
    return task


def expected_answer(prompt: str) -> str:
    """The exact text the demo model must answer to `prompt` (leading space included)."""
    task, _, body = prompt.partition(" ")
    items = body.split(" ")
    if task == "count" and body and all(x.isdigit() for x in items):
        last = int(items[-1])
        return "".join(f" {last + i}" for i in range(1, COUNT_CONTINUATION + 1))
    if task == "reverse" and body.isalpha() and body.islower() and body.isascii():
        return " " + body[::-1]
    if task == "sort" and body and all(len(x) == 1 and x.isdigit() for x in items):
        return "".join(f" {d}" for d in sorted(items))
    raise ValueError(f"not a demo prompt: {prompt!r}")


def chat(prompt: str) -> list[dict[str, str]]:
    """The single-turn conversation the demo model was trained on."""
    return [{"role": "user", "content": prompt}]
