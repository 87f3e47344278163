"""Frontend-side state of one engine: config, model facts, registered names, pending requests.

It lives on the engine's InputProcessor, the object every request passes through in the
frontend (offline `LLM` and the API server alike), so two engines in one process never mix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..config import HookConfig
from ..model.layout import PointTable
from ..spec.resolve import ModelInfo, Resolved

STATE_ATTR = "_vllm_hook_state"
PENDING_TTL_S = 24 * 3600.0


@dataclass
class FrontendState:
    cfg: HookConfig
    info: ModelInfo
    points: PointTable
    max_model_len: int
    names: dict[str, tuple[str, float]] = field(default_factory=dict)   # name -> (digest, norm)
    pending: dict[str, tuple[float, Resolved]] = field(default_factory=dict)
    # Seconds spent delivering results, summed: where a large capture's time goes.
    timing: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("fetches", "fetch_rpc_s", "read_s", "build_s"), 0.0))

    def add_pending(self, request_id: str, res: Resolved) -> None:
        now = time.monotonic()
        if len(self.pending) > 10000:
            for rid in [r for r, (t, _) in self.pending.items() if now - t > PENDING_TTL_S]:
                del self.pending[rid]
        self.pending[request_id] = (now, res)

    def pop_pending(self, request_id: str) -> Resolved | None:
        item = self.pending.pop(request_id, None)
        return item[1] if item else None


def state_of(input_processor: Any) -> FrontendState:
    st = input_processor.__dict__.get(STATE_ATTR)
    if st is None:
        vc = input_processor.vllm_config
        cfg = HookConfig.from_vllm_config(vc)
        info = ModelInfo.from_model_config(input_processor.model_config)
        st = FrontendState(cfg=cfg, info=info, points=PointTable.for_config(info.num_layers, cfg),
                           max_model_len=int(input_processor.model_config.max_model_len))
        input_processor.__dict__[STATE_ATTR] = st
    return st


def maybe_state(input_processor: Any) -> FrontendState | None:
    return input_processor.__dict__.get(STATE_ATTR)
