"""Hooks the operator installs, which clients call by name with JSON arguments.

A module registers factories with `@vllm_hook.operator_hook("name")`; each factory takes
JSON-typed keyword arguments (checked with pydantic against its signature) and returns a
`Hook` (or a list of them). The engine imports the modules named in the config key
`hook_modules` and every entry point of the group `vllm_hook.hooks`, in the frontend (to
check a request's hooks) and in every worker (to build them); the built-in hooks
(`hooks/builtin.py`) are always there. This is the safe way to offer hooks on a server:
no client code is executed.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from importlib.metadata import entry_points
from typing import Any, Callable

from pydantic import ValidationError, validate_call

from .hook import Hook

log = logging.getLogger("vllm_hook")
ENTRY_POINT_GROUP = "vllm_hook.hooks"
_FACTORIES: dict[str, Callable[..., Any]] = {}
_DOCS: dict[str, str] = {}
_loaded: set[str] = set()


class HookArgsError(ValueError):
    pass


def operator_hook(name: str) -> Callable:
    """Decorator: make `factory(**json_args) -> Hook | list[Hook]` callable by `name`."""
    def register(factory: Callable) -> Callable:
        _FACTORIES[name] = validate_call(factory)
        _DOCS[name] = (inspect.getdoc(factory) or "").split("\n\n")[0]
        return factory
    return register


def load(modules: tuple[str, ...] | list[str] = ()) -> None:
    """Import the built-in hooks, `modules` and the entry points (each once)."""
    for mod in ("vllm_hook.hooks.builtin", *modules):
        if mod not in _loaded:
            importlib.import_module(mod)
            _loaded.add(mod)
    if "<entry points>" not in _loaded:
        _loaded.add("<entry points>")
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                ep.load()
            except Exception:
                log.exception("vllm_hook: operator hook entry point %s failed to load", ep.name)


def build(name: str, args: dict) -> list[Hook]:
    """The hooks `name` makes from `args`; HookArgsError names what is wrong."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise KeyError(name)
    try:
        made = factory(**(args or {}))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "args"
        raise HookArgsError(f"argument {where}: {first['msg']}") from None
    except TypeError as e:
        raise HookArgsError(str(e)) from None
    hooks = list(made) if isinstance(made, (list, tuple)) else [made]
    if not hooks or not all(isinstance(h, Hook) for h in hooks):
        raise TypeError(f"operator hook {name!r} returned {type(made).__name__}, not a Hook")
    return hooks


def available() -> dict[str, str]:
    """{name: first paragraph of its docstring}."""
    return dict(sorted(_DOCS.items()))
