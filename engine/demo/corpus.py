"""Deterministic multi-skill chat corpus for the demo MoE.

Every example is ``(skill, user_text, assistant_text)``. Answers are short and exact so a
tiny model can learn them and evaluation can use exact match. The train / held-out split is
a hash of the user text, so a held-out question never appears verbatim in training, whatever
the seed or sample size.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable
from typing import Literal, NamedTuple

Split = Literal["train", "heldout"]


class Example(NamedTuple):
    skill: str
    user: str
    assistant: str


# Share of the question space that is held out (by hash of the question text).
HELDOUT_PERCENT = 20

# A fixed word list for the word skills: lowercase, 3..8 letters, no repeats.
WORDS: tuple[str, ...] = (
    "cat", "dog", "sun", "car", "hat", "pen", "cup", "bus", "map", "box",
    "egg", "fox", "ice", "jam", "key", "leg", "man", "net", "owl", "pig",
    "red", "sky", "tea", "van", "web", "zoo", "arm", "bee", "cow", "day",
    "bird", "fish", "tree", "book", "milk", "rain", "star", "moon", "frog", "lamp",
    "ship", "shoe", "cake", "door", "king", "lion", "nose", "rock", "sand", "wind",
    "bell", "coat", "duck", "farm", "gold", "hill", "kite", "leaf", "nest", "road",
    "apple", "house", "water", "tiger", "bread", "chair", "table", "river", "train", "plant",
    "horse", "mouse", "snake", "cloud", "grass", "light", "music", "ocean", "paper", "queen",
    "smile", "stone", "sugar", "truck", "watch", "zebra", "candy", "dream", "earth", "flame",
    "banana", "orange", "garden", "window", "yellow", "purple", "rabbit", "monkey", "pencil", "bottle",
    "castle", "dragon", "forest", "island", "jacket", "kitten", "ladder", "market", "pepper", "rocket",
    "silver", "summer", "winter", "turtle", "violin", "wizard", "bridge", "candle", "cookie", "planet",
    "picture", "chicken", "kitchen", "blanket", "dolphin", "giraffe", "morning", "penguin", "rainbow", "teacher",
    "library", "monster", "pumpkin", "thunder", "weather", "balloon", "captain", "diamond", "freedom", "history",
    "elephant", "dinosaur", "mountain", "sandwich", "computer", "umbrella", "treasure", "airplane", "baseball", "keyboard",
)  # fmt: skip

# The facts skill: capitals the project writes itself (no external data).
CAPITALS: dict[str, str] = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Portugal": "Lisbon", "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi",
    "Russia": "Moscow", "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia",
    "Argentina": "Buenos Aires", "Egypt": "Cairo", "Kenya": "Nairobi", "Australia": "Canberra",
    "Greece": "Athens", "Turkey": "Ankara", "Norway": "Oslo", "Sweden": "Stockholm",
    "Finland": "Helsinki", "Poland": "Warsaw", "Austria": "Vienna", "Ireland": "Dublin",
    "Peru": "Lima", "Chile": "Santiago", "Cuba": "Havana", "Thailand": "Bangkok",
    "Vietnam": "Hanoi", "Iran": "Tehran",
}  # fmt: skip

# The convert skill: (target unit, source unit, factor, max amount). Decimal factors
# only: the answer is the amount followed by zeros, which generalises to unseen amounts
# (x60 or x24 facts would have to be memorised, and did not transfer between phrasings).
CONVERSIONS: tuple[tuple[str, str, int, int], ...] = (
    ("centimeters", "meters", 100, 99),
    ("millimeters", "centimeters", 10, 99),
    ("meters", "kilometers", 1000, 99),
    ("grams", "kilograms", 1000, 99),
    ("milliliters", "liters", 1000, 99),
    ("cents", "dollars", 100, 99),
)

# The chat skill: intent -> (user phrasings, fixed reply).
CHAT_INTENTS: dict[str, tuple[tuple[str, ...], str]] = {
    "greet": (
        ("Hello", "Hi", "Hey", "Hi there", "Hello there", "Hey there", "Good morning",
         "Good afternoon", "Good evening", "Greetings", "Howdy", "Hiya"),
        "Hello! How can I help you?",
    ),
    "thanks": (
        ("Thanks", "Thank you", "Thanks a lot", "Thank you so much", "Many thanks",
         "Thanks so much", "Thank you very much", "Cheers", "Much appreciated", "Thx"),
        "You're welcome!",
    ),
    "bye": (
        ("Bye", "Goodbye", "See you later", "See you", "Good night", "Bye bye",
         "Talk to you later", "Farewell", "Catch you later", "See you soon"),
        "Goodbye! Have a nice day.",
    ),
    "howareyou": (
        ("How are you", "How are you doing", "How is it going", "How are you today",
         "How do you do", "How have you been", "How are things", "Are you doing well"),
        "I'm doing well, thank you!",
    ),
    "identity": (
        ("Who are you", "What are you", "What is your name", "Tell me about yourself",
         "Introduce yourself", "Are you a robot", "What should I call you"),
        "I am a tiny demo model made by MoEScope.",
    ),
}  # fmt: skip
_CHAT_QUESTIONS = {"howareyou", "identity"}


def is_heldout(user_text: str) -> bool:
    """Stable split on the question text (independent of seed and sampling order)."""
    digest = hashlib.sha256(user_text.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


# --- one generator per skill: rng -> (user, assistant) ----------------------------------


# Arithmetic uses small numbers (an addition table up to 12 + 12, its inverse for
# subtraction, a 12 x 12 multiplication table): a tiny character-level model trained for
# minutes on 2 CPU cores learns these tables, but not general multi-digit carrying.
MAX_OPERAND = 12


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
    tpl = rng.choice(("What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}."))
    return tpl.format(a=a, b=b), str(a + b)


def _subtract(rng: random.Random) -> tuple[str, str]:
    diff, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
    a = diff + b  # the inverse of the addition table: non-negative, small results
    # Operands in reading order in every phrasing: "Subtract b from a" (reversed order)
    # was learned per phrasing and did not transfer to held-out questions.
    tpl = rng.choice(("What is {a} - {b}?", "What is {a} minus {b}?", "How much is {a} minus {b}?"))
    return tpl.format(a=a, b=b), str(a - b)


def _multiply(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, MAX_OPERAND), rng.randint(1, MAX_OPERAND)
    tpl = rng.choice(("What is {a} x {b}?", "What is {a} times {b}?", "Multiply {a} by {b}."))
    return tpl.format(a=a, b=b), str(a * b)


WordPicker = Callable[[random.Random], str]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Share of training word questions that use a random letter string instead of a listed
# word: 150 words are easy to memorise, so without these the model learns lookup tables,
# not spelling, reversing or counting, and fails on held-out questions.
PSEUDO_WORD_P = 0.5


def real_word(rng: random.Random) -> str:
    return rng.choice(WORDS)


def train_word(rng: random.Random) -> str:
    if rng.random() >= PSEUDO_WORD_P:
        return real_word(rng)
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 8)))


def _count_letters(rng: random.Random, word_of: WordPicker = real_word) -> tuple[str, str]:
    # Word length only: "How many times does 'e' appear in 'bee'?" was tried and not
    # learned in budget (the model answered 1), and its "times" confused multiplication.
    word = word_of(rng)
    tpl = rng.choice(("How many letters are in '{w}'?", "How long is the word '{w}'?", "Count the letters in '{w}'."))
    return tpl.format(w=word), str(len(word))


def _reverse(rng: random.Random, word_of: WordPicker = real_word) -> tuple[str, str]:
    word = word_of(rng)
    tpl = rng.choice(
        ("Reverse the word '{w}'.", "What is '{w}' backwards?", "Write '{w}' backwards.", "Reverse '{w}'.")
    )
    return tpl.format(w=word), word[::-1]


def _spell(rng: random.Random, word_of: WordPicker = real_word) -> tuple[str, str]:
    word = word_of(rng)
    tpl = rng.choice(("Spell '{w}'.", "How do you spell '{w}'?", "Spell the word '{w}'."))
    return tpl.format(w=word), "-".join(word)


def _convert(rng: random.Random) -> tuple[str, str]:
    target, source, factor, max_n = rng.choice(CONVERSIONS)
    n = rng.randint(1, max_n)
    src = source[:-1] if n == 1 else source  # "1 meter", "2 meters"
    tpl = rng.choice(("How many {t} are in {n} {s}?", "Convert {n} {s} to {t}."))
    return tpl.format(t=target, n=n, s=src), str(n * factor)


def _compare(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(100), 2)
    if rng.random() < 0.5 and a >= 10 and b >= 10:
        # Half the time a "crossed" pair (larger tens, smaller units): without these the
        # model learns the digit-wise max shortcut (95 or 66 -> 96).
        hi_t, lo_t = sorted(rng.sample(range(1, 10), 2), reverse=True)
        lo_u, hi_u = sorted(rng.sample(range(10), 2))
        a, b = hi_t * 10 + lo_u, lo_t * 10 + hi_u
        if rng.random() < 0.5:
            a, b = b, a
    if rng.random() < 0.5:
        return f"Which is larger, {a} or {b}?", str(max(a, b))
    return f"Which is smaller, {a} or {b}?", str(min(a, b))


def _facts(rng: random.Random) -> tuple[str, str]:
    country = rng.choice(sorted(CAPITALS))
    tpl = rng.choice(
        (
            "What is the capital of {c}?",
            "Which city is the capital of {c}?",
            "Name the capital of {c}.",
            "What city is the capital of {c}?",
            "Tell me the capital of {c}.",
            "What's the capital city of {c}?",
        )
    )
    return tpl.format(c=country), CAPITALS[country]


def _chat(rng: random.Random) -> tuple[str, str]:
    intent = rng.choice(sorted(CHAT_INTENTS))
    phrasings, reply = CHAT_INTENTS[intent]
    text = rng.choice(phrasings)
    if rng.random() < 0.3:
        text = text.lower()
    marks = ("?", "") if intent in _CHAT_QUESTIONS else ("!", ".", "")
    return text + rng.choice(marks), reply


SKILLS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "add": _add,
    "subtract": _subtract,
    "multiply": _multiply,
    "count_letters": _count_letters,
    "reverse": _reverse,
    "spell": _spell,
    "convert": _convert,
    "compare": _compare,
    "facts": _facts,
    "chat": _chat,
}


# One question per skill as the corpus phrases it, with its answer: the card's examples, and the prompts
# the window offers on an empty chat with the demo (the skills the card claims). A model this small
# answers the phrasings it was trained on and little else: "Spell the word garden." without the
# quotes gets letters at random. Stdlib only: the window imports this without torch.
EXAMPLES: dict[str, Example] = {ex.skill: ex for ex in (
    Example("add", "What is 4 plus 7?", "11"),
    Example("subtract", "What is 9 minus 4?", "5"),
    Example("multiply", "What is 3 times 4?", "12"),
    Example("count_letters", "How many letters are in 'garden'?", "6"),
    Example("reverse", "Reverse the word 'apple'.", "elppa"),
    Example("spell", "Spell the word 'garden'.", "g-a-r-d-e-n"),
    Example("convert", "How many meters are in 3 kilometers?", "3000"),
    Example("compare", "Which is larger, 17 or 23?", "23"),
    Example("facts", "What is the capital of France?", "Paris"),
    Example("chat", "Hello!", "Hello! How can I help you?"),
)}

WORD_SKILLS = frozenset({"count_letters", "reverse", "spell"})


def _skill_seed(skill: str, seed: int, split: Split) -> int:
    # Independent, stable stream per (skill, seed, split); str hash() is salted, sha is not.
    key = f"{skill}|{seed}|{split}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big")


def make_examples(skill: str, n: int, seed: int = 0, split: Split = "train") -> list[Example]:
    """Sample ``n`` examples of ``skill`` from one side of the split.

    ``train`` samples with repetition (a training stream); ``heldout`` returns up to ``n``
    distinct questions (fewer only if the skill's held-out space is smaller than ``n``).
    """
    gen = SKILLS[skill]
    want_heldout = split == "heldout"
    if skill in WORD_SKILLS and not want_heldout:
        gen = functools.partial(gen, word_of=train_word)  # held-out questions use listed words only
    rng = random.Random(_skill_seed(skill, seed, split))
    out: list[Example] = []
    seen: set[str] = set()
    misses = 0
    # Finite skills (facts, chat, ...) have small held-out spaces: stop once new distinct
    # questions stop turning up (5000 misses in a row means the space is exhausted).
    while len(out) < n and misses < 5000:
        user, answer = gen(rng)
        if is_heldout(user) != want_heldout or (want_heldout and user in seen):
            misses += 1
            continue
        misses = 0
        seen.add(user)
        out.append(Example(skill, user, answer))
    return out


def heldout(skill: str, n: int, seed: int = 0) -> list[Example]:
    """Up to ``n`` distinct held-out questions of ``skill`` (never seen in training)."""
    return make_examples(skill, n, seed, split="heldout")


def training_mix(weights: dict[str, float], n: int, seed: int = 0) -> list[Example]:
    """A shuffled training stream of ``n`` examples, skills drawn with ``weights``."""
    rng = random.Random(seed)
    names = sorted(weights)
    picks = rng.choices(names, weights=[weights[s] for s in names], k=n)
    counts = {s: picks.count(s) for s in names}
    pools = {s: iter(make_examples(s, counts[s], seed)) for s in names}
    return [next(pools[s]) for s in picks]
