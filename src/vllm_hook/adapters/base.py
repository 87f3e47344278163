"""What the runner adapters hand to the runtime: immutable per-step views, no vLLM types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import numpy as np


class StepView(NamedTuple):
    """The batch of one forward pass, as the model sees it (built every hooked step: a tuple
    is cheapest)."""

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
    # request id -> (block ids per KV cache group, whether they replace or extend the known ones)
    blocks: Mapping[str, tuple[tuple[list[int], ...], bool]] = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.blocks is None:
            object.__setattr__(self, "blocks", {})

    @property
    def empty(self) -> bool:
        return not self.new and not self.finished and not self.resumed and not self.blocks


def wire_of(sampling_params: Any, key: str) -> dict | None:
    extra = getattr(sampling_params, "extra_args", None) if sampling_params is not None else None
    if not extra:
        return None
    w = extra.get(key)
    return w if isinstance(w, dict) and w.get("v") == 1 else None


@dataclass
class AttnLayer:
    """What the runtime needs to recompute one layer's attention weights outside the model:
    the parameters of its kernel, its heads on this rank, and how to read its paged keys."""

    layer: int
    num_heads: int                    # on this rank
    num_kv_heads: int                 # on this rank
    head_size: int
    scale: float
    softcap: float                    # 0: none
    window: int | None                # sliding window (keys with q_pos - k_pos < window)
    q_heads: list[int]                # global index of each local query head
    kv_heads: list[int]               # global index of each local KV head
    keys: Any                         # keys(block_ids[int64], offsets[int64]) -> [n, kv_heads, D]
    geometry: Any                     # geometry() -> (kv cache group, block size)
