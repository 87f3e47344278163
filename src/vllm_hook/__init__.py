"""vllm-hook: per-request capture and steering of model internals inside vLLM's batch."""

__version__ = "0.1.0"

from .api import delete_vectors, register_vectors, stats  # noqa: E402
from .client import AsyncClient, Client  # noqa: E402
from .config import HookConfig  # noqa: E402
from .results import Results, results  # noqa: E402
from .spec import HookRuntimeError, HookSpec, SpecError, UnknownVectorError, encode_vector  # noqa: E402

__all__ = [
    "AsyncClient", "Client",
    "HookConfig", "HookRuntimeError", "HookSpec", "Results", "SpecError", "UnknownVectorError",
    "delete_vectors", "encode_vector", "register_vectors", "results", "stats", "__version__",
]
