"""One parse and one resolve per distinct spec, not per request.

A batch usually sends one spec for many prompts (and vLLM deep-copies each request's
SamplingParams, so the copies are equal, not identical): the parsed spec is kept by its
content, the resolved one by content, and by prompt length too where the spec names token
positions (resolved against the prompt's length; else only the wire's "P" and the
cached-prefix rule depend on it, set per request). Each request still gets its own key. Named vectors enter the
resolution (digest, norm): registering or deleting one clears the cache.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
from collections import OrderedDict
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

import numpy as np
import torch

from ..hooks.hook import Hook
from ..spec.rescale import Template
from ..spec.resolve import Resolved

MAX_ENTRIES = 256
MAX_KEY_BYTES = 64 << 10      # larger specs (large inline vectors) are resolved every time


class _NotCacheable(Exception):
    pass


class _KeyPickler(pickle.Pickler):
    """Pickles a spec's content exactly, at C speed for dicts, lists, strings and numbers (a
    28-op spec in 4 to 15 µs on the CI machine from day to day, sorted JSON in about 6x as
    long); a Hook by identity (vLLM's deep copy keeps one Hook object per batch). Offline, one
    spec object is pickled once per call (`one_call`). Tensors and arrays are
    refused: the parsed spec would hold the first request's object, which its owner may
    change in place."""

    def __init__(self, f, keep: list):
        super().__init__(f, protocol=5)
        self.keep = keep

    def reducer_override(self, o):
        if isinstance(o, Hook):
            self.keep.append(o)               # alive while cached: its id is not reused
            return str, (f"<hook {id(o)}>",)
        if isinstance(o, (torch.Tensor, np.ndarray, memoryview, bytearray)):
            raise _NotCacheable
        return NotImplemented


def cache_key(raw: Any) -> tuple[Any, list]:
    """(the spec's content as bytes, objects the entry must keep alive) or (None, []) when it
    holds values without a cheap exact form, or is large. Equal content, equal key: vLLM
    deep-copies each request's SamplingParams, so a batch's copies are equal, not identical
    (and a dict's key order is kept by the copy)."""
    if isinstance(raw, (str, bytes)):
        return (raw, []) if len(raw) <= MAX_KEY_BYTES else (None, [])
    got = getattr(_LOCAL, "pickler", None)
    if got is None:                  # one per thread, reused: making one was a third of a key
        buf = io.BytesIO()
        got = _LOCAL.pickler = (buf, _KeyPickler(buf, []))
    buf, p = got
    buf.seek(0)
    buf.truncate()
    keep: list = []
    p.keep = keep
    try:
        p.dump(raw)
    except (_NotCacheable, pickle.PicklingError, TypeError, ValueError, AttributeError, RecursionError):
        _LOCAL.pickler = None        # a fresh one next time, whatever state this one is in
        return None, []
    finally:
        p.clear_memo()               # the memo holds the objects it pickled
    key = buf.getvalue()
    if len(key) > MAX_KEY_BYTES:
        _LOCAL.pickler = None        # nor is its buffer kept at that size
        return None, []
    return key, keep


_LOCAL = threading.local()

# While one `LLM.generate` call adds its requests (`one_call`): spec objects already keyed,
# by identity. vLLM deep-copies each request's params, but `admission.sealed` passes the
# caller's spec object through: one passed for many prompts is pickled once per call, not per
# request (a 28-op spec's admission 22 -> 7 µs a request on the CI machine).
_CALL_KEYS: ContextVar[dict | None] = ContextVar("vllm_hook_call_keys", default=None)
MAX_CALL_KEYS = 64


@contextmanager
def one_call() -> Iterator[None]:
    """Around one call that adds requests: a spec object cannot change within it (the caller
    is inside vLLM), so its key is computed once. Between calls it may (a loop editing one
    dict): the memo goes with the call."""
    token = _CALL_KEYS.set({})
    try:
        yield
    finally:
        _CALL_KEYS.reset(token)


def call_key(raw: Any) -> tuple[Any, list]:
    """`cache_key(raw)`, once per spec object and call where `one_call` is active."""
    memo = _CALL_KEYS.get()
    if memo is None or isinstance(raw, (str, bytes)):
        return cache_key(raw)
    got = memo.get(id(raw))
    if got is None or got[0] is not raw:          # held in the memo: its id is not reused
        got = (raw, *cache_key(raw))
        if len(memo) < MAX_CALL_KEYS:
            memo[id(raw)] = got
    return got[1], got[2]


def own_copy(res: Resolved, prompt_len: int | None = None) -> Resolved:
    """A request's own Resolved: a new key, a wire dict of its own; items and worst_bytes
    shared. A shallow copy made by hand: copy.copy of a dataclass goes through
    __reduce_ex__, 10 µs a request. `prompt_len`: that of the request, when `res` was
    resolved for another length of a spec that names no positions (`HookSpec.positional`)."""
    out = object.__new__(Resolved)
    key = os.urandom(16).hex()
    out.__dict__ = {**res.__dict__, "key": key, "wire": {**res.wire, "key": key}}
    if prompt_len is not None and prompt_len != res.prompt_len:
        out.prompt_len = out.wire["P"] = prompt_len
        out.reads_cached_prefix = prompt_len >= res.prefix_from
    return out


class ResolvedCache:
    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._specs: OrderedDict[str, tuple[Any, list]] = OrderedDict()
        self._resolved: OrderedDict[tuple[str, int], tuple[Resolved, list]] = OrderedDict()
        # by (shape key, prompt length for a spec naming positions, else None): `spec.rescale`
        self._shapes: OrderedDict[tuple[bytes, int | None], Template] = OrderedDict()
        self._shapes_seen: OrderedDict[bytes, None] = OrderedDict()
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

    def get(self, key: str, prompt_len: int, positional: bool = True) -> Resolved | None:
        """A copy of the resolution kept for the spec, with a key of its own: kept per prompt
        length for a spec naming positions, else one for every length (a dataset's prompts
        differ in length: each would resolve again)."""
        k = (key, prompt_len if positional else None)
        got = self._resolved.get(k)
        if got is None:
            return None
        self._resolved.move_to_end(k)
        self.hits += 1
        return own_copy(got[0], prompt_len)

    def resolved(self, key: str, prompt_len: int) -> Resolved | None:
        """`get` for a spec not parsed here (kept by `put` from its shape's template: a
        strength sweep repeats its strengths), whether or not it names positions."""
        if not self._resolved:
            return None
        got = self.get(key, prompt_len, False)
        return got if got is not None else self.get(key, prompt_len, True)

    def put(self, key: str, prompt_len: int, res: Resolved, keep: list, positional: bool = True) -> Resolved:
        """Keep `res`; the request that resolved it gets a copy (the kept one is never a request's)."""
        self._resolved[(key, prompt_len if positional else None)] = (res, keep)
        while len(self._resolved) > self.max_entries:
            self._resolved.popitem(last=False)
        return own_copy(res)

    def shape(self, key: bytes, prompt_len: int) -> Template | None:
        """The template kept for a spec shape (`spec.rescale.split`) and prompt length."""
        k = (key, None)
        got = self._shapes.get(k)
        if got is None:
            k = (key, prompt_len)
            got = self._shapes.get(k)
        if got is not None:
            self._shapes.move_to_end(k)
        return got

    def second_sight(self, key: bytes) -> bool:
        """Whether a spec of this shape was resolved before: a template is kept from the
        second on (specs of shapes of their own would each pay for one)."""
        if key in self._shapes_seen:
            return True
        self._shapes_seen[key] = None
        while len(self._shapes_seen) > self.max_entries:
            self._shapes_seen.popitem(last=False)
        return False

    def put_shape(self, key: bytes, prompt_len: int, positional: bool, t: Template) -> None:
        self._shapes[(key, prompt_len if positional else None)] = t
        while len(self._shapes) > self.max_entries:
            self._shapes.popitem(last=False)

    def clear(self) -> None:
        self._specs.clear()
        self._resolved.clear()
        self._shapes.clear()
        self._shapes_seen.clear()
