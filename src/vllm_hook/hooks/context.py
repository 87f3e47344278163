"""What a hook function receives as `ctx`.

One `HookContext` per (request, hook): `saved` persists across layers and steps of the
request; the per-call fields (`layer_idx`, `positions`, ...) are set before each call.
Positions and prompt flags are CPU tensors built only when read.
"""

from __future__ import annotations

from typing import Any

import torch

from .state import CtxList, append_call, append_rows


class HookContext:
    __slots__ = ("saved", "request_id", "prompt_len", "tp_rank", "tp_size", "layer_idx", "pre",
                 "_first_pos", "_rows", "_params")

    def __init__(self, request_id: str, prompt_len: int, params: Any,
                 tp_rank: int = 0, tp_size: int = 1):
        self.saved: dict[str, Any] = {}
        self.request_id, self.prompt_len = request_id, prompt_len
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.layer_idx, self.pre = 0, False
        self._first_pos, self._rows = 0, 0
        self._params = params

    def _at(self, layer: int, pre: bool, first_pos: int, rows: int) -> "HookContext":
        self.layer_idx, self.pre, self._first_pos, self._rows = layer, pre, first_pos, rows
        return self

    @property
    def seq_len(self) -> int:
        """Rows in this call (vllm-lens' name)."""
        return self._rows

    @property
    def num_rows(self) -> int:
        return self._rows

    @property
    def positions(self) -> torch.Tensor:
        """Token position of each row (CPU int64)."""
        return torch.arange(self._first_pos, self._first_pos + self._rows, dtype=torch.int64)

    @property
    def is_prompt(self) -> torch.Tensor:
        """Whether each row is a prompt token (CPU bool)."""
        return self.positions < self.prompt_len

    @property
    def first_position(self) -> int:
        return self._first_pos

    def save(self, key: str, t: torch.Tensor) -> None:
        """Append `t` (this call's rows, [rows, ...]) to `saved[key]`: results hold one tensor
        per call, which travel (and `to_host` copies) as one."""
        append_rows(key, t, [self.saved], [(0, t.shape[0] if t.dim() else 1)] if isinstance(t, torch.Tensor) else [(0, 0)])

    def get_parameter(self, name: str) -> torch.Tensor:
        """A full model parameter (gathered over tensor-parallel ranks, cached), e.g.
        "lm_head.weight" or "model.norm.weight"."""
        return self._params(name)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The model's final norm applied to `h` (a logit lens: then @ lm_head.weight.T)."""
        return self._params.final_norm(h)


_ONE_EACH: dict[int, list[tuple[int, int]]] = {}


def _one_each(n: int) -> list[tuple[int, int]]:
    """[(0, 1), (1, 1), ...]: one row per request (shared: never changed)."""
    got = _ONE_EACH.get(n)
    if got is None:
        got = [(i, 1) for i in range(n)]
        if n <= 4096:
            _ONE_EACH[n] = got
    return got


class BatchHookContext:
    """`ctx` of a `batched=True` hook: the rows of several requests in one call. Row block
    i of `h` belongs to `requests[i]` (its `saved`, `request_id`, ...)."""

    __slots__ = ("requests", "segments", "layer_idx", "pre", "num_layers", "tp_rank", "tp_size", "_params")

    def __init__(self, requests: list[HookContext], segments: list[tuple[int, int]], layer: int,
                 pre: bool, params: Any, tp_rank: int = 0, tp_size: int = 1, num_layers: int = 0):
        self.requests, self.segments = requests, segments
        self.layer_idx, self.pre, self.num_layers = layer, pre, num_layers
        self.tp_rank, self.tp_size, self._params = tp_rank, tp_size, params

    @property
    def counts(self) -> list[int]:
        return [n for _, n in self.segments]

    @property
    def positions(self) -> torch.Tensor:
        return torch.cat([c.positions for c in self.requests]) if self.requests else torch.zeros(0, dtype=torch.int64)

    @property
    def is_prompt(self) -> torch.Tensor:
        return torch.cat([c.is_prompt for c in self.requests]) if self.requests else torch.zeros(0, dtype=torch.bool)

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        """`t` (first dimension = rows of `h`) cut into each request's rows (views)."""
        return list(torch.split(t, self.counts))

    def save(self, key: str, t: torch.Tensor, per_request: bool = False) -> None:
        """Append each request's rows of `t` (first dimension = rows of `h`; with
        `per_request`, one row per request) to its `saved[key]`. One call records where each
        request's rows are; nothing is sliced per request until its results are delivered."""
        reqs = self.requests
        segs = _one_each(len(reqs)) if per_request else self.segments
        grouped = reqs.__class__ is CtxList and reqs.epochs is not None
        if per_request:
            want = len(reqs)
        elif grouped:          # the worker's groups: back-to-back segments from row 0
            want = segs[-1][0] + segs[-1][1] if segs else 0
        else:
            want = sum(n for _, n in segs)
        rows = t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else -1
        if rows != want:
            raise ValueError(f"ctx.save({key!r}, t): t has {rows} rows, this call has {want}"
                             + ("" if per_request else " (per_request=True: one row per request)"))
        if grouped:
            append_call(key, t, reqs, segs)
        else:
            append_rows(key, t, [c.saved for c in reqs], segs)

    def get_parameter(self, name: str) -> torch.Tensor:
        return self._params(name)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self._params.final_norm(h)
