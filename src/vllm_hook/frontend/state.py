"""Frontend-side state of one engine: config, model facts, registered names, pending requests.

It lives on the engine's InputProcessor, the object every request passes through in the
frontend (offline `LLM` and the API server alike), so two engines in one process never mix.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..adapters.requests import engine_facts, forwards_drafts
from ..config import HookConfig
from ..gc_clock import process_clock
from ..model.layout import PointTable
from ..spec.resolve import ModelInfo, Resolved
from .cache import ResolvedCache

STATE_ATTR = "_vllm_hook_state"
PENDING_TTL_S = 24 * 3600.0
# Set in a process that serves vLLM's HTTP app: its requests come from clients, whose Python
# hooks run only with allow_client_code.
SERVED = {"on": False}


@dataclass
class FrontendState:
    cfg: HookConfig
    info: ModelInfo
    points: PointTable
    max_model_len: int
    drafts: bool = False           # the engine forwards draft tokens (`adapters.requests.forwards_drafts`)
    names: dict[str, tuple[str, float]] = field(default_factory=dict)   # name -> (digest, norm)
    pending: dict[str, tuple[float, Resolved]] = field(default_factory=dict)
    persistent_hooks: int = 0      # registered on the workers: every request is hooked
    # Requests finished here since the last collect: their persistent-hook results must be
    # final on the workers, which learn of a finish only at their next step.
    finished: deque = field(default_factory=lambda: deque(maxlen=100_000))
    resolved: ResolvedCache = field(default_factory=ResolvedCache)   # one resolve per distinct spec
    # Seconds spent delivering results, summed: where a large capture's time goes (encode_s:
    # served responses' results into safetensors, inline or kept for a handle).
    timing: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("admitted", "admit_s", "fetches", "fetch_rpc_s", "rpc_to_worker_s", "rpc_back_s", "read_s",
         "build_s", "read_build_page_faults", "encode_s", "delivered_without_fetch", "early_fetches",
         "fetched_while_running", "read_ahead_s", "delivered_built_ahead", "results_from_parts"), 0.0))
    # Each rank's result arena (its token; None: none), as the last fetch's replies named
    # them: where a steering-only request's clean mark is read (`delivery.arena`).
    arena_tokens: tuple = ()
    # An offline call's fetch sent at its last step (`frontend.delivery.Early`), until `attach`.
    early: Any = None
    # Served: requests whose results are complete at their prompt, until their first token
    # (`frontend.delivery.FirstTokens`); None offline.
    first_tokens: Any = None
    # Tickets: a random prefix (several frontends of one engine never share a tag) and a count.
    _tickets: Iterator[int] = field(default_factory=lambda: itertools.count(
        (secrets.randbits(30) + 1) << 32 | 1))

    def __post_init__(self) -> None:
        process_clock()          # counting from the engine's start

    def counters(self) -> dict[str, float]:
        """The delivery timing, and this process's seconds in Python's collector."""
        return {**self.timing, **process_clock().counters()}

    def capture_limit(self) -> int:
        """max_capture_bytes_per_request, its default read from the host once (admission checks
        it per request: two sysconf calls each)."""
        got = self.__dict__.get("_capture_limit")
        if got is None:
            got = self.__dict__["_capture_limit"] = self.cfg.capture_limits()[0]
        return got

    def next_ticket(self) -> int:
        """A steering-only request's ticket: unique (a 30-bit random prefix, a 32-bit count)."""
        return next(self._tickets)

    def add_pending(self, request_id: str, res: Resolved) -> None:
        now = time.monotonic()
        if len(self.pending) > 10000:
            for rid in [r for r, (t, _) in self.pending.items() if now - t > PENDING_TTL_S]:
                del self.pending[rid]
        self.pending[request_id] = (now, res)

    def note_finished(self, request_ids) -> None:
        self.finished.extend(request_ids)

    def take_finished(self) -> list[str]:
        out = list(self.finished)
        self.finished.clear()
        return out

    def pop_pending(self, request_id: str) -> Resolved | None:
        item = self.pending.pop(request_id, None)
        return item[1] if item else None


def state_of(input_processor: Any) -> FrontendState:
    st = input_processor.__dict__.get(STATE_ATTR)
    if st is not None:
        return st
    # vLLM 0.33's AsyncLLM admits raw prompts on its renderer's thread, beside the event loop.
    with _STATE_LOCK:
        st = input_processor.__dict__.get(STATE_ATTR)
        if st is None:
            vc, info, max_model_len = engine_facts(input_processor)
            cfg = HookConfig.from_vllm_config(vc)
            st = FrontendState(cfg=cfg, info=info, points=PointTable.for_config(info.num_layers, cfg),
                               max_model_len=max_model_len, drafts=forwards_drafts(vc))
            input_processor.__dict__[STATE_ATTR] = st
    return st


_STATE_LOCK = threading.Lock()


def allow_pickles(st: FrontendState) -> bool:
    return st.cfg.allow_client_code or not SERVED["on"]


def maybe_state(input_processor: Any) -> FrontendState | None:
    return input_processor.__dict__.get(STATE_ATTR)
