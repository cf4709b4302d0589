"""A built-in corpus of generated short stories (``data.source = "sample"``): documents of a
few words to a few thousand characters from a small grammar, so that a model's loss falls
quickly. It needs no download and makes the same documents on every machine."""

from __future__ import annotations

import random
from collections.abc import Iterator

_SUBJECTS = ["the cat", "a dog", "the old sailor", "my sister", "the river", "a small bird",
             "the baker", "an owl", "the children", "a tired horse"]
_VERBS = ["sees", "follows", "remembers", "paints", "carries", "watches", "finds", "loses"]
_OBJECTS = ["the moon", "a red boat", "the long road", "an apple", "the quiet town",
            "a letter", "the winter garden", "a lantern"]
_ENDINGS = ["and that was the end of it.", "and nobody ever knew why.",
            "and the night grew quiet.", "and so the day began again."]


def documents(n: int = 400, seed: int = 0) -> Iterator[str]:
    """``n`` stories; story i is the same for any ``n``."""
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + i)
        k = rng.choice([1, 2, 3, 6, 12, 25, 60])
        body = " ".join(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."
                        for _ in range(k))
        yield f"Story {i}. {body} {rng.choice(_ENDINGS)}"
