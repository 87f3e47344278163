"""Engine-wide named steering vectors: validated here, stored on every worker."""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import numpy as np

from ..spec.errors import SpecError
from ..spec.vectors import check_vector, decode_vector, vector_digest
from .delivery import RPC
from .state import FrontendState

NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


def prepare(st: FrontendState, vectors: Mapping[str, Any]
            ) -> tuple[dict[str, bytes], dict[str, tuple[str, float]]]:
    """Checked float32 bytes of each vector, and its (digest, norm) for admission."""
    limit = st.cfg.max_named_vectors
    count = len(set(st.names) | set(vectors))
    if count > limit:
        raise SpecError("vectors", f"registering these would make {count} named vectors, more than "
                        f"max_named_vectors ({limit}; each takes hidden_size x 4 bytes on every "
                        "worker)", "delete vectors no longer needed (delete_vectors, DELETE "
                        "/v1/hook/vectors/{name}) or raise additional_config vllm_hook.max_named_vectors")
    payload, digests = {}, {}
    for name, value in vectors.items():
        where = f"vectors[{name!r}]"
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise SpecError(where, "invalid vector name", "use 1-128 characters from A-Z a-z 0-9 _ . : -")
        arr = decode_vector(value, where)
        if isinstance(arr, str):
            raise SpecError(where, "a vector cannot be registered as another name", "pass values")
        arr = check_vector(arr, st.info.hidden_size, where, need_norm=False)
        payload[name] = arr.tobytes()
        digests[name] = (vector_digest(arr), float(np.linalg.norm(arr.astype(np.float64))))
    return payload, digests


def register(st: FrontendState, vectors: Mapping[str, Any], rpc: Callable[..., list]) -> list[str]:
    payload, digests = prepare(st, vectors)
    rpc(RPC, args=("register_vectors", payload))
    st.names.update(digests)
    st.resolved.clear()           # specs naming them resolve again
    return sorted(st.names)


def delete(st: FrontendState, names: list[str], rpc: Callable[..., list]) -> list[str]:
    rpc(RPC, args=("delete_vectors", list(names)))
    for n in names:
        st.names.pop(n, None)
    st.resolved.clear()
    return sorted(st.names)
