"""Offline API on a `vllm.LLM`: named vectors and engine statistics."""

from __future__ import annotations

from typing import Any, Mapping

from .frontend import vectors as _vectors
from .frontend.delivery import RPC, checked
from .frontend.state import state_of


def _state(llm: Any):
    return state_of(llm.llm_engine.input_processor)


def register_vectors(llm: Any, vectors: Mapping[str, Any]) -> list[str]:
    """Store named steering vectors on the engine; specs may then name them. Returns all names."""
    return _vectors.register(_state(llm), vectors, llm.collective_rpc)


def delete_vectors(llm: Any, names: list[str]) -> list[str]:
    return _vectors.delete(_state(llm), names, llm.collective_rpc)


def stats(llm: Any) -> dict:
    """Worker-side counters of rank 0 (admitted requests, retained bytes, table use, seconds
    spent in fetches, ...), and under "frontend" this process's delivery timing (seconds in
    the fetch RPC, reading results, building `Results`, summed)."""
    out = dict(checked(llm.collective_rpc(RPC, args=("stats",)))[0])
    out["frontend"] = dict(_state(llm).timing)
    return out


__all__ = ["register_vectors", "delete_vectors", "stats"]
