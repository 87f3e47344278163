"""Steering vectors in every form a client may send them, decoded to float32 numpy."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import numpy as np

from .errors import SpecError

_B64_DTYPES = ("float32", "bfloat16", "float16")


def decode_vector(value: Any, where: str) -> np.ndarray | str:
    """A vector as float32 numpy, or the name of a registered vector (returned as str)."""
    if isinstance(value, str):
        if not value:
            raise SpecError(where, "empty vector name", "pass a registered vector's name")
        return value
    if isinstance(value, dict):
        return _from_b64(value, where)
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor, without importing torch
        value = value.detach().float().cpu().numpy()
    fix = 'pass a list of floats, a numpy array, a torch tensor, {"b64": ..., "dtype": "float32"} or a registered name'
    try:
        raw = np.asarray(value)
    except (TypeError, ValueError, RecursionError):
        raise SpecError(where, f"cannot read a vector from {type(value).__name__}", fix) from None
    if raw.dtype.kind not in "fiu":      # bools, strings, objects (ragged or mixed lists)
        what = {"b": "booleans", "U": "strings", "S": "bytes"}.get(raw.dtype.kind, "values that are not all numbers")
        raise SpecError(where, f"a vector's values must be numbers, got {what}", fix)
    with np.errstate(over="ignore", invalid="ignore"):
        arr = raw.astype(np.float32)
    if raw.dtype.kind == "f" and raw.dtype.itemsize > 4:
        over = int((np.isfinite(raw) & ~np.isfinite(arr)).sum())
        if over:
            raise SpecError(where, f"{over} values are beyond float32's range (|v| <= 3.4e38)",
                            "scale the vector down; the steering scale carries its size")
    if arr.ndim != 1:
        raise SpecError(where, f"expected a 1-D vector, got shape {tuple(arr.shape)}",
                        "pass one vector of size hidden_size")
    return arr


def _from_b64(value: dict, where: str) -> np.ndarray:
    extra = set(value) - {"b64", "dtype"}
    if "b64" not in value or extra:
        raise SpecError(where, f"unexpected vector object keys {sorted(value)}",
                        'use {"b64": <base64 of raw little-endian bytes>, "dtype": "float32"}')
    dtype = value.get("dtype", "float32")
    if dtype not in _B64_DTYPES:
        raise SpecError(where, f"unsupported dtype {dtype!r}", f"use one of {_B64_DTYPES}")
    try:
        raw = base64.b64decode(value["b64"], validate=True)
    except Exception:
        raise SpecError(where, "b64 is not valid base64", "encode the raw bytes with base64") from None
    width = 4 if dtype == "float32" else 2
    if len(raw) % width:
        raise SpecError(where, f"{len(raw)} bytes is not a whole number of {dtype} values",
                        "send the raw bytes of the vector")
    if dtype == "float32":
        return np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if dtype == "float16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32)
    bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32)


def encode_vector(vec: Any, dtype: str = "float32") -> dict:
    """The inverse of the b64 form: what a client puts on the wire."""
    arr = np.asarray(vec.detach().float().cpu().numpy() if hasattr(vec, "detach") else vec,
                     dtype=np.float32)
    if dtype == "float32":
        raw = arr.astype("<f4").tobytes()
    elif dtype == "float16":
        raw = arr.astype("<f2").tobytes()
    elif dtype == "bfloat16":
        raw = (arr.view(np.uint32) >> 16).astype("<u2").tobytes()
    else:
        raise ValueError(f"dtype must be one of {_B64_DTYPES}")
    return {"b64": base64.b64encode(raw).decode("ascii"), "dtype": dtype}


def check_vector(arr: np.ndarray, hidden: int, where: str, need_norm: bool) -> np.ndarray:
    if arr.shape[0] != hidden:
        raise SpecError(where, f"expected {hidden} values (the model's hidden_size), got {arr.shape[0]}",
                        f"pass a vector of length {hidden}")
    if not np.isfinite(arr).all():
        bad = int((~np.isfinite(arr)).sum())
        raise SpecError(where, f"vector has {bad} NaN or infinite values", "pass finite values")
    if need_norm and not float(np.linalg.norm(arr)) > 0.0:
        raise SpecError(where, "vector has zero norm, so its direction is undefined",
                        "pass a non-zero vector")
    return np.ascontiguousarray(arr, dtype=np.float32)


def vector_digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr, dtype=np.float32).tobytes()).hexdigest()[:32]
