"""Deterministic natural-language prompts: a fixed text whose token windows the parity
tests use, and the short prompts and chat the server tests send."""
from __future__ import annotations

TEXT = """\
The history of the lighthouse begins with fires lit on hilltops to guide ships home at night. \
The Pharos of Alexandria, finished around 280 BC, stood more than a hundred metres tall and was \
counted among the wonders of the ancient world. For centuries its keepers burned wood and oil, and \
sailors could see the glow from far out at sea. Later towers used mirrors, then lenses: in 1822 \
Augustin Fresnel designed a lens of concentric rings that bent light into a narrow, powerful beam, \
and within a few decades his design had spread to coasts all over the world.

Bread is one of the oldest prepared foods. A simple loaf needs only flour, water, salt and yeast, \
yet the baker controls many variables: the protein content of the flour, the temperature of the \
dough, the length of the rise, and the heat of the oven. A long, cool fermentation develops more \
flavour, while a hot oven with steam gives a crisp, shiny crust. Sourdough replaces commercial \
yeast with a culture of wild yeasts and lactic acid bacteria, which is why it tastes slightly sour.

In computing, a cache keeps a copy of data close to where it is needed so that repeated requests \
are served quickly. The hard part is deciding what to keep when space runs out. A least recently \
used policy evicts the entry that has gone unused for the longest time, on the theory that the \
recent past predicts the near future. Databases, web browsers, processors and operating systems \
all rely on caches, and a surprising amount of engineering goes into keeping them consistent.

Mountain weather changes quickly. A clear morning can turn into a storm by early afternoon as warm \
air rises along the slopes, cools, and condenses into towering clouds. Experienced hikers start \
early, carry layers and rain gear, and turn back when thunder is heard, even if the summit is close. \
The temperature drops by roughly six degrees Celsius for every thousand metres of climbing, so a \
pleasant day in the valley can mean freezing wind on the ridge.

Learning a musical instrument rewards patience. Beginners often want to play whole songs at once, \
but teachers recommend short, focused practice: a few bars at a slow tempo, repeated until they are \
clean, then gradually faster. A metronome keeps the rhythm honest. Recording yourself is humbling \
but useful, because it is hard to hear your own mistakes while you are busy making them.
"""

# 12 prompts from 5 to 400 tokens, starting at different offsets so they share no prefix.
PROMPT_SHAPES = [(0, 5), (40, 9), (90, 16), (7, 30), (150, 48), (60, 75), (220, 110), (15, 150), (280, 200),
                 (25, 260), (120, 330), (3, 400)]


def parity_prompts(token_ids: list[int]) -> list[list[int]]:
    assert len(token_ids) >= max(start + length for start, length in PROMPT_SHAPES), len(token_ids)
    return [token_ids[start : start + length] for start, length in PROMPT_SHAPES]

# Short prompts and a chat for the OpenAI-compatible server's tests.
PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "The future of AI is",
    "def fibonacci(n):",
    "Once upon a time,",
    "The largest planet in the solar system is",
    "Water boils at",
    "My favourite colour is",
]
CHAT = [{"role": "user", "content": "Say hello in one short sentence."}]
