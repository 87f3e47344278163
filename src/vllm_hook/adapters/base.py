"""What the runner adapters hand to the runtime: immutable per-step views, no vLLM types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np


@dataclass(frozen=True)
class StepView:
    """The batch of one forward pass, as the model sees it."""

    index: Mapping[str, int]        # request id -> batch position (only scheduled requests)
    query_start_loc: np.ndarray     # [num_reqs + 1]; rows of request i: qsl[i] .. qsl[i+1]-1
    num_computed: np.ndarray        # [num_reqs]; position of each request's first row
    num_tokens: int                 # real rows
    num_tokens_padded: int          # rows the model runs (CUDA-graph padding included)


@dataclass(frozen=True)
class NewRequest:
    req_id: str
    wire: dict | None               # the spec's wire form, or None
    prompt_len: int


@dataclass(frozen=True)
class SchedulerEvents:
    """The request lifecycle events of one step."""

    new: tuple[NewRequest, ...] = ()
    finished: frozenset[str] = frozenset()
    resumed: frozenset[str] = frozenset()

    @property
    def empty(self) -> bool:
        return not self.new and not self.finished and not self.resumed


def wire_of(sampling_params: Any, key: str) -> dict | None:
    extra = getattr(sampling_params, "extra_args", None) if sampling_params is not None else None
    if not extra:
        return None
    w = extra.get(key)
    return w if isinstance(w, dict) and w.get("v") == 1 else None
