"""Prompts built from named parts, with each part's exact token span.

Each piece of text (a part, or the chat template's own text between parts) is tokenized on its
own and the ids are concatenated, so a part's span is exact by construction. Send the returned
`token_ids` to the engine (`{"prompt_token_ids": ids}`), not the text: re-tokenizing the text
could merge tokens across a part boundary and shift the spans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

Part = tuple  # (name, text) or (name, text, role); name None = unnamed glue text

_MARK = "\x00vllm_hook_part_{}\x00"


@dataclass(frozen=True)
class BuiltPrompt:
    token_ids: list[int]
    spans: dict[str, tuple[int, int]]  # name -> half-open [start, end) token positions
    text: str  # the text the ids came from (for display)

    def __len__(self) -> int:
        return len(self.token_ids)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids) if text else []


def _parse(parts: Sequence[Any]) -> list[tuple[str | None, str, str]]:
    out, seen = [], set()
    for i, p in enumerate(parts):
        if not isinstance(p, (tuple, list)) or len(p) not in (2, 3):
            raise ValueError(f"parts[{i}] must be (name, text) or (name, text, role), got {p!r}")
        name, text = p[0], p[1]
        role = p[2] if len(p) == 3 else "user"
        if not isinstance(text, str):
            raise ValueError(f"parts[{i}] ({name!r}): text must be a string, got {type(text).__name__}")
        if name is not None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"parts[{i}]: name must be a non-empty string or None (unnamed text)")
            if name in seen:
                raise ValueError(f"parts[{i}]: duplicate part name {name!r}; names must be unique")
            if not text:
                raise ValueError(f"parts[{i}] ({name!r}) is empty; a named part needs text (an empty span "
                                 "cannot be analyzed)")
            seen.add(name)
        out.append((name, text, role))
    return out


def build_prompt(tokenizer, parts: Sequence[Part], *, chat_template: bool = False,
                 add_generation_prompt: bool = True, add_special_tokens: bool = True) -> BuiltPrompt:
    """Token ids and spans of `parts`, in order.

    Without a chat template the parts are concatenated as given (include your own separators),
    after the tokenizer's own prefix (e.g. BOS) when `add_special_tokens`. With
    `chat_template=True`, consecutive parts with the same role (third tuple item, default
    "user") form one message and the tokenizer's chat template is rendered around them.
    """
    items = _parse(parts)
    if chat_template:
        segments = _chat_segments(tokenizer, items, add_generation_prompt)
    else:
        prefix = list(tokenizer("", add_special_tokens=True).input_ids) if add_special_tokens else []
        pre_text = tokenizer.decode(prefix) if prefix else ""
        segments = [(None, pre_text, prefix)] + [(n, t, None) for n, t, _ in items]
    ids: list[int] = []
    spans: dict[str, tuple[int, int]] = {}
    text = ""
    for name, seg_text, seg_ids in segments:
        seg_ids = _ids(tokenizer, seg_text) if seg_ids is None else seg_ids
        if name is not None:
            if not seg_ids:
                raise ValueError(f"part {name!r} tokenizes to no tokens; give it some text")
            spans[name] = (len(ids), len(ids) + len(seg_ids))
        ids += seg_ids
        text += seg_text
    return BuiltPrompt(token_ids=ids, spans=spans, text=text)


def _chat_segments(tokenizer, items, add_generation_prompt):
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_template=True but this tokenizer has no chat template; pass "
                         "chat_template=False and write the separators into the parts")
    # Render the template once with a unique marker per part, then cut at the markers: the text
    # between markers is the template's own (tokenized alone), each marker becomes its part.
    messages: list[dict] = []
    for i, (_, _, role) in enumerate(items):
        mark = _MARK.format(i)
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += mark
        else:
            messages.append({"role": role, "content": mark})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    segments = []
    rest = rendered
    for i, (name, text, _) in enumerate(items):
        mark = _MARK.format(i)
        if rest.count(mark) != 1:
            raise ValueError("the chat template does not render each message's content exactly once; "
                             "use chat_template=False for this tokenizer")
        before, rest = rest.split(mark)
        segments += [(None, before, None), (name, text, None)]
    segments.append((None, rest, None))
    return segments
