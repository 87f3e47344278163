"""One parse and one resolve per distinct spec, not per request.

A batch usually sends one spec for many prompts (and vLLM deep-copies each request's
SamplingParams, so the copies are equal, not identical): the parsed spec is kept by its
content, the resolved one by content and prompt length (selectors, prompt checks and the
cached-prefix rule depend on it). Each request still gets its own key. Named vectors enter the
resolution (digest, norm): registering or deleting one clears the cache.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections import OrderedDict
from typing import Any

from ..hooks.hook import Hook
from ..spec.resolve import Resolved

MAX_ENTRIES = 256
MAX_KEY_CHARS = 64 << 10      # larger specs (inline vectors) are resolved every time


class _NotCacheable(Exception):
    pass


def cache_key(raw: Any) -> tuple[str | None, list]:
    """(the spec's content as text, objects the entry must keep alive) or (None, []) when
    it holds values without a cheap exact text (tensors, arrays) or is large."""
    if isinstance(raw, (str, bytes)):
        text = raw if isinstance(raw, str) else raw.decode("utf-8", "replace")
        return (text, []) if len(text) <= MAX_KEY_CHARS else (None, [])
    keep: list = []

    def default(o):
        if isinstance(o, Hook):           # one object per batch (Hook.__deepcopy__)
            keep.append(o)                # alive while cached: its id is not reused
            return f"<hook {id(o)}>"
        raise _NotCacheable

    try:
        text = json.dumps(raw, sort_keys=True, default=default)
    except (_NotCacheable, TypeError, ValueError, RecursionError):
        return None, []
    return (text, keep) if len(text) <= MAX_KEY_CHARS else (None, [])


class ResolvedCache:
    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._specs: OrderedDict[str, tuple[Any, list]] = OrderedDict()
        self._resolved: OrderedDict[tuple[str, int], tuple[Resolved, list]] = OrderedDict()
        self.hits = 0

    def spec(self, key: str):
        got = self._specs.get(key)
        if got is not None:
            self._specs.move_to_end(key)
        return got[0] if got else None

    def put_spec(self, key: str, spec: Any, keep: list) -> None:
        self._specs[key] = (spec, keep)
        while len(self._specs) > self.max_entries:
            self._specs.popitem(last=False)

    def get(self, key: str, prompt_len: int) -> Resolved | None:
        got = self._resolved.get((key, prompt_len))
        if got is None:
            return None
        self._resolved.move_to_end((key, prompt_len))
        self.hits += 1
        res = got[0]
        fresh = uuid.uuid4().hex
        return dataclasses.replace(res, key=fresh, wire={**res.wire, "key": fresh})

    def put(self, key: str, prompt_len: int, res: Resolved, keep: list) -> None:
        self._resolved[(key, prompt_len)] = (res, keep)
        while len(self._resolved) > self.max_entries:
            self._resolved.popitem(last=False)

    def clear(self) -> None:
        self._specs.clear()
        self._resolved.clear()
