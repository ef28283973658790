"""Chat and instruction examples -> token ids and labels, loss on the assistant's tokens only.

A conversation is rendered by the tokenizer's chat template (`apply_chat_template`); an instruction example
is the conversation [user: prompt, assistant: response]. Which tokens are the assistant's comes from
  - the template's `{% generation %}` blocks, when it has them (transformers' `return_assistant_tokens_mask`);
  - otherwise, prefixes: the tokens of messages[:i] rendered with the generation prompt must start the
    tokens of messages[:i + 1]; what messages[:i + 1] adds after that prefix is assistant turn i (its text
    and the template's end-of-turn tokens, which the model must learn to emit). A template for which this
    prefix property fails (one that rewrites earlier turns) is refused with the fix: add generation blocks.
Every other token (system and user turns, role headers, the generation prompt, padding) gets the label
IGNORE_INDEX (-100), so it carries no loss.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeAlias

from transformers import PreTrainedTokenizerBase

from dsx3d.errors import UserError
from dsx3d.recipe.schema import DataSection

Message: TypeAlias = dict[str, str]
"""One chat message: role and content (what `apply_chat_template` reads)."""

IGNORE_INDEX = -100

DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{%- else -%}"
    "{{ message['content'] + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)
"""The template dsx3d gives the byte-level BPE it trains (that tokenizer has none):
`<|user|>\\n{content}\\n<|assistant|>\\n{content}<|endoftext|>` per turn. The role headers are plain text;
an assistant turn ends with the eos token, so a fine-tuned model learns to stop."""

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def template_text(data: DataSection) -> str | None:
    """data.chat_template as Jinja text: the value itself, or the file it names. None when unset."""
    value = data.chat_template
    if value is None:
        return None
    if "{" not in value:  # a Jinja template always holds {{ or {%; anything else is a path
        path = Path(value).expanduser()
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise UserError.single(
                "data.chat_template",
                value,
                f"not a Jinja template and not a readable file ({err})",
                "give the template text (it contains {{ or {%) or the path of a file holding it",
            ) from None
    return value


def chat_template_for(data: DataSection, tokenizer: PreTrainedTokenizerBase, trained: bool) -> str | None:
    """The template that renders `data`'s examples: data.chat_template, else the tokenizer's, else (for the
    tokenizer dsx3d trains) DEFAULT_CHAT_TEMPLATE. None when the format needs none (text) or none exists."""
    if not data.masked:
        return None
    own = template_text(data)
    if own is not None:
        return own
    existing = getattr(tokenizer, "chat_template", None)
    if isinstance(existing, str) and existing:
        return existing
    return DEFAULT_CHAT_TEMPLATE if trained else None


def missing_template_problem(data: DataSection, where: str) -> UserError:
    return UserError.single(
        "data.chat_template",
        None,
        f"data.format {data.format} needs a chat template and the tokenizer ({where}) has none",
        "set data.chat_template to a Jinja template (or a file holding one) with {% generation %} blocks "
        "around assistant turns, or use a tokenizer that ships one",
    )


def example_messages(row: dict[str, Any], data: DataSection) -> list[Message]:
    """The conversation of one row of a chat or instruction dataset (columns named as in dsx3d.data.corpus)."""
    if data.format == "instruction":
        return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
    return list(row["messages"])


def message_problem(messages: object) -> str | None:
    """Why `messages` is not a conversation with at least one assistant turn (None when it is)."""
    if not isinstance(messages, list) or not messages:
        return "is not a non-empty list of messages"
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return "holds a message without a string role and content"
    if not any(m["role"] == "assistant" for m in messages):
        return "has no assistant message (nothing to train on)"
    return None


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], template: str
) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one conversation: labels are the ids on the assistant's tokens, -100 elsewhere."""
    if _GENERATION.search(template):
        out: Any = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        ids, mask = _prefix_mask(tokenizer, messages, template)
    return ids, [i if m else IGNORE_INDEX for i, m in zip(ids, mask, strict=True)]


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[Message], template: str, prompt: bool) -> list[int]:
    out: Any = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=True, add_generation_prompt=prompt
    )
    return list(out["input_ids"])


def _prefix_mask(tokenizer: PreTrainedTokenizerBase, messages: list[Message], template: str) -> tuple[list[int], list[int]]:
    ids = _render(tokenizer, messages, template, prompt=False)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], template, prompt=True) if i else []
        through = _render(tokenizer, messages[: i + 1], template, prompt=False)
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise UserError.single(
                "data.chat_template",
                "(the template)",
                "the assistant's tokens cannot be told apart: rendering the conversation up to a turn does not "
                "give a prefix of the whole conversation",
                "add {% generation %} ... {% endgeneration %} around the assistant's content in the template",
            )
        mask[len(before) : len(through)] = [1] * (len(through) - len(before))
    return ids, mask
