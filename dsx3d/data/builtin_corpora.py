"""The built-in corpora named by a 'builtin:' source: Python's own documentation as text, and the tiny chat set."""

from __future__ import annotations

from collections.abc import Callable

from dsx3d.data.tiny_chat import tiny_chat_conversations, tiny_preference_pairs
from dsx3d.errors import UserError
from dsx3d.recipe.schema import DataSection

BUILTIN_PREFIX = "builtin:"


def python_docs_documents() -> list[str]:
    """Python's language reference as shipped in `pydoc_data.topics` (the text behind `help("if")`).

    About half a megabyte of English prose and code in every CPython install, so a recipe trains with no
    download. Each topic is split at its section headings (a line underlined with = - * ~ or ^), giving
    a few hundred documents of a few KB each. Topics are taken in sorted order, so the list is stable.
    """
    from pydoc_data.topics import topics

    documents: list[str] = []
    for name in sorted(topics):
        documents.extend(_split_sections(topics[name]))
    return documents


def _split_sections(text: str) -> list[str]:
    lines = text.split("\n")
    starts = [0]
    for i in range(1, len(lines) - 1):
        title, rule = lines[i].rstrip(), lines[i + 1].rstrip()
        if title and len(rule) == len(title) and len(set(rule)) == 1 and rule[0] in "=-*~^":
            starts.append(i)
    bounds = zip(starts, starts[1:] + [len(lines)], strict=True)
    sections = ["\n".join(lines[a:b]).strip() for a, b in bounds]
    return [s for s in sections if s]


BUILTINS: dict[str, Callable[[], list[str]]] = {"python-docs": python_docs_documents}


BUILTIN_CHATS: dict[str, Callable[[], list[list[dict[str, str]]]]] = {"tiny-chat": tiny_chat_conversations}


BUILTIN_PREFERENCES: dict[str, Callable[[], list[dict[str, list[dict[str, str]]]]]] = {"tiny-preference": tiny_preference_pairs}


def builtin_problem(data: DataSection) -> UserError | None:
    """Why data.source names no builtin usable with data.format (None when it names one)."""
    name = data.source[len(BUILTIN_PREFIX) :]
    if name not in BUILTINS and name not in BUILTIN_CHATS and name not in BUILTIN_PREFERENCES:
        known = ", ".join(BUILTIN_PREFIX + n for n in [*BUILTINS, *BUILTIN_CHATS, *BUILTIN_PREFERENCES])
        return UserError.single("data.source", data.source, "unknown builtin corpus", f"use one of: {known}")
    kind = "text" if name in BUILTINS else "chat" if name in BUILTIN_CHATS else "preference"
    if kind != data.format:
        return UserError.single(
            "data.source",
            data.source,
            f"a builtin {kind} corpus, and data.format is {data.format}",
            f"set data.format to {kind}, or use a builtin {data.format} corpus or your own data",
        )
    return None
