"""Chat prompts with message boundaries: which token span of the prompt each message is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MessageBoundary:
    role: str
    start: int          # token positions [start, end) of the prompt
    end: int
    content: str

    @property
    def start_token(self) -> int:       # chatspace's names
        return self.start

    @property
    def end_token(self) -> int:
        return self.end


def _ids(tok: Any, messages: list[dict], **kw) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


def chat_prompt(tok: Any, messages: list[dict], continue_final_message: bool = False,
                **template_kw) -> tuple[list[int], list[MessageBoundary]]:
    """The prompt's token ids and a boundary per message, covering every token once: each
    message's span runs to the end of its own template rendering (so its role header and end
    token are its own); the generation prompt (`<|im_start|>assistant` and the like), when
    added, is a last span of role "generation_prompt"."""
    if not messages:
        raise ValueError("chat: no messages")
    last = dict(add_generation_prompt=not continue_final_message, continue_final_message=continue_final_message)
    full = _ids(tok, messages, **last, **template_kw)
    bounds, start = [], 0
    for i, m in enumerate(messages):
        kw = last if (i == len(messages) - 1 and continue_final_message) else {}
        ids = _ids(tok, messages[:i + 1], **kw, **template_kw)
        if full[:len(ids)] != ids or len(ids) < start:
            raise ValueError("this chat template does not render a conversation's first messages as a "
                             "prefix of the whole, so message boundaries are not defined for it")
        bounds.append(MessageBoundary(m.get("role", ""), start, len(ids), str(m.get("content", ""))))
        start = len(ids)
    if start < len(full):
        bounds.append(MessageBoundary("generation_prompt", start, len(full), ""))
    return full, bounds
