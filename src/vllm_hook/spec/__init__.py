"""Request spec: schema (shape), resolution against model and prompt, vectors, errors."""

from .errors import HookRuntimeError, SpecError, UnknownVectorError
from .resolve import ModelInfo, Resolved, resolve, selected_mask
from .schema import SPEC_KEY, HookSpec, parse_spec
from .vectors import decode_vector, encode_vector

__all__ = [
    "SPEC_KEY", "HookSpec", "HookRuntimeError", "ModelInfo", "Resolved", "SpecError",
    "UnknownVectorError", "decode_vector", "encode_vector", "parse_spec", "resolve",
    "selected_mask",
]
