"""Ways to cut a text into stream deltas, for the tests that stream parsers."""
from __future__ import annotations

import random


def chunkings(text: str, seed: int) -> list[list[str]]:
    """The text whole, one character at a time, and six seeded random cuttings."""
    rng = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(6):
        pieces, pos = [], 0
        while pos < len(text):
            n = rng.randint(1, 9)
            pieces.append(text[pos:pos + n])
            pos += n
        out.append(pieces)
    return out
