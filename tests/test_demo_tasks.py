"""The demo tasks: the answers the issue specifies, and a held-out split training never sees."""

from __future__ import annotations

import random

import pytest

from jaxllm import demo_tasks


def test_expected_answers_match_the_specified_examples():
    assert demo_tasks.expected_answer("count 17 18 19") == " 20 21 22 23 24"
    assert demo_tasks.expected_answer("count 998") == " 999 1000 1001 1002 1003"
    assert demo_tasks.expected_answer("reverse abcdef") == " fedcba"
    assert demo_tasks.expected_answer("sort 5 9 1 7") == " 1 5 7 9"
    assert demo_tasks.expected_answer("sort 3 3 0") == " 0 3 3"


@pytest.mark.parametrize("bad", ["", "count", "count x", "reverse ABC", "reverse a1",
                                 "sort 12 3", "sort", "add 1 2"])
def test_expected_answer_rejects_non_demo_prompts(bad):
    with pytest.raises(ValueError):
        demo_tasks.expected_answer(bad)


@pytest.mark.parametrize("task", demo_tasks.TASKS)
def test_training_prompts_never_come_from_the_heldout_split(task):
    heldout = set(demo_tasks.heldout_prompts(task, 200, seed=0))
    rng = random.Random(1)
    train = {demo_tasks.make_prompt(task, rng) for _ in range(3000)}
    assert not train & heldout
    assert all(demo_tasks.is_heldout(p) for p in heldout)


@pytest.mark.parametrize("task", demo_tasks.TASKS)
def test_prompts_stay_inside_the_task_ranges(task):
    rng = random.Random(0)
    for _ in range(2000):
        prompt = demo_tasks.make_prompt(task, rng)
        body = prompt.split(" ", 1)[1]
        answer = demo_tasks.expected_answer(prompt)
        if task == "count":
            numbers = [int(x) for x in (body + answer).split()]
            assert 1 <= len(body.split()) <= 4 and max(numbers) <= demo_tasks.COUNT_MAX
            assert len(answer.split()) == demo_tasks.COUNT_CONTINUATION
        elif task == "reverse":
            assert 3 <= len(body) <= 12
        else:
            assert 2 <= len(body.split()) <= 8


def test_heldout_prompts_are_distinct_and_reproducible():
    a = demo_tasks.heldout_prompts("sort", 150, seed=3)
    assert len(set(a)) == 150 and a == demo_tasks.heldout_prompts("sort", 150, seed=3)
    assert a != demo_tasks.heldout_prompts("sort", 150, seed=4)
