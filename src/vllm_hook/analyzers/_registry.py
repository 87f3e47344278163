"""Name -> analyzer class."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")
_REGISTRY: dict[str, type] = {}


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make an analyzer available as `vllm_hook.analyzers.get(name)`."""
    def deco(cls: T) -> T:
        old = _REGISTRY.get(name)
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise ValueError(f"analyzer name {name!r} is already registered by {old.__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def get(name: str) -> type:
    """The analyzer class registered as `name`."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown analyzer {name!r}; available: {available()}") from None


def available() -> list[str]:
    return sorted(_REGISTRY)
