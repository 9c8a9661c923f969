"""A deterministic synthetic text corpus, generated from a seed.

No downloads: the corpus is produced by a small stochastic grammar (sentences,
lists and arithmetic facts) with enough structure that a tiny LM visibly learns
it in a minute, and enough entropy that it keeps learning for a while.
"""

from __future__ import annotations

import functools

import numpy as np

_NOUNS = ("cat", "dog", "replica", "node", "river", "model", "garden", "engine", "ring",
          "lighthouse", "packet", "tensor", "city", "forest", "queue", "signal")
_ADJS = ("quick", "lazy", "healthy", "silent", "bright", "broken", "distant", "small",
         "green", "steady", "shared", "sharded")
_VERBS = ("sees", "follows", "repairs", "sends", "guards", "trains", "fetches", "waits for",
          "joins", "leaves", "reduces", "checks")
_PLACES = ("near the sea", "in the cluster", "after the storm", "before dawn", "on the ring",
           "under the bridge", "at step one", "in the quorum")


def _sentence(rng: np.random.Generator) -> str:
    kind = rng.integers(0, 6)
    n1, n2 = rng.choice(_NOUNS, 2)
    a1, a2 = rng.choice(_ADJS, 2)
    v = rng.choice(_VERBS)
    if kind == 0:
        return f"The {a1} {n1} {v} the {a2} {n2}."
    if kind == 1:
        return f"A {n1} {v} a {n2} {rng.choice(_PLACES)}."
    if kind == 2:
        x, y = (int(t) for t in rng.integers(0, 50, 2))
        return f"{x} plus {y} is {x + y}."
    if kind == 3:
        k = int(rng.integers(2, 6))
        items = ", ".join(rng.choice(_NOUNS, k))
        return f"List: {items}."
    if kind == 4:
        return f"Every {n1} is {a1}, but no {n2} is {a2}."
    x = int(rng.integers(1, 10))
    return f"Count {x}: " + " ".join(str(i) for i in range(x, x + 4)) + "."


@functools.lru_cache(maxsize=8)
def generate_corpus(seed: int, num_bytes: int) -> np.ndarray:
    """`num_bytes` bytes of text (uint8) determined entirely by `seed`."""
    if num_bytes < 1024:
        raise ValueError(f"corpus of {num_bytes} bytes is too small; use at least 1024")
    rng = np.random.default_rng(np.random.PCG64([seed, 0xC0FFEE]))
    parts: list[str] = []
    size = 0
    while size < num_bytes:
        para = " ".join(_sentence(rng) for _ in range(int(rng.integers(3, 8)))) + "\n"
        parts.append(para)
        size += len(para)
    data = np.frombuffer("".join(parts).encode("ascii"), dtype=np.uint8)[:num_bytes]
    data = data.copy()
    data.setflags(write=False)
    return data
