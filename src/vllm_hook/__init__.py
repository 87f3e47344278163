"""vllm-hook: per-request capture and steering of model internals inside vLLM's batch."""

__version__ = "0.1.0"

from .api import (  # noqa: E402
    clear_hook_results, clear_hooks, collect_hook_results, delete_vectors, prefetch_params,
    register_hooks, register_vectors, stats,
)
from .client import AsyncClient, Client, NotFoundError, ServerError  # noqa: E402
from .config import ConfigError, HookConfig  # noqa: E402
from .extract.dataset import ActivationDataset, load_dataset  # noqa: E402
from .hooks import BatchHookContext, Hook, HookContext, operator_hook  # noqa: E402
from .results import Results, results  # noqa: E402
from .spec import HookRuntimeError, HookSpec, SpecError, UnknownVectorError, encode_vector  # noqa: E402
from .spec.lens import SteeringVector  # noqa: E402
from .session import AsyncSteerModel, ChatResponse, HookLLM, SteerModel, SteerResponse  # noqa: E402

__all__ = [
    "SteeringVector", "HookLLM", "SteerModel", "AsyncSteerModel", "SteerResponse", "ChatResponse",
    "ActivationDataset", "AsyncClient", "BatchHookContext", "ConfigError", "Client", "Hook", "HookConfig", "HookContext",
    "HookRuntimeError", "HookSpec", "NotFoundError", "ServerError", "Results", "SpecError", "UnknownVectorError",
    "clear_hook_results", "clear_hooks", "collect_hook_results", "delete_vectors", "encode_vector",
    "load_dataset", "operator_hook", "prefetch_params", "register_hooks", "register_vectors", "results", "stats",
    "__version__",
]
