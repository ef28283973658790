"""builtin:tiny-chat: a few hundred short conversations generated in code, for SFT recipes and tests.

Small tasks a tiny model can learn in a few hundred steps on a CPU (arithmetic, the next weekday, reversing
and upper-casing words, counting letters), some with a system message, some with two user turns. The list
is a pure function of nothing: the same conversations on every machine, no file to download or ship.
"""

from __future__ import annotations

import random

WORDS = (
    "cat dog bird fish tree rock river cloud stone apple bread honey lamp door chair table green blue red "
    "yellow window garden pencil paper music light night water fire earth wind"
).split()
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SYSTEMS = ["You are a helpful assistant.", "Answer in one short sentence.", "Be brief."]
NUM_CONVERSATIONS = 400


def _task(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(20), rng.randrange(20)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        i = rng.randrange(7)
        return f"Which day comes after {DAYS[i]}?", f"{DAYS[(i + 1) % 7]} comes after {DAYS[i]}."
    word = rng.choice(WORDS)
    if kind == 2:
        return f"Spell {word} backwards.", f"{word} backwards is {word[::-1]}."
    if kind == 3:
        return f"Write {word} in capitals.", f"{word.upper()}"
    return f"How many letters are in {word}?", f"{word} has {len(word)} letters."


def tiny_chat_conversations(n: int = NUM_CONVERSATIONS) -> list[list[dict[str, str]]]:
    rng = random.Random(15)
    conversations = []
    for _ in range(n):
        messages: list[dict[str, str]] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
        for _turn in range(1 if rng.random() < 0.7 else 2):
            question, answer = _task(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        conversations.append(messages)
    return conversations


def _wrong(rng: random.Random, question: str, answer: str) -> str:
    """A dispreferred answer to `question`: a wrong one of the same shape, or an evasive one."""
    if rng.random() < 0.5:
        return rng.choice(["I do not know.", "That is not something I can answer.", "Maybe ask someone else."])
    if question.startswith("What is"):
        a, b = (int(w.rstrip("?")) for w in question.split()[2::2])
        return f"{a} plus {b} is {a + b + rng.choice([-2, -1, 1, 3])}."
    if question.startswith("Which day"):
        day = question.split()[-1].rstrip("?")
        return f"{DAYS[(DAYS.index(day) + 3) % 7]} comes after {day}."
    return answer[::-1]


def tiny_preference_pairs(n: int = NUM_CONVERSATIONS) -> list[dict[str, list[dict[str, str]]]]:
    """builtin:tiny-preference: TRL's conversational preference records (prompt / chosen / rejected message lists):
    the tasks above, the right answer chosen and a wrong or evasive one rejected."""
    rng = random.Random(33)
    pairs = []
    for _ in range(n):
        question, answer = _task(rng)
        prompt = [{"role": "user", "content": question}]
        if rng.random() < 0.2:
            prompt.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
        pairs.append({
            "prompt": prompt,
            "chosen": [{"role": "assistant", "content": answer}],
            "rejected": [{"role": "assistant", "content": _wrong(rng, question, answer)}],
        })  # fmt: skip
    return pairs
