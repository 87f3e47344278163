"""Patch vLLM classes when (and only if) their modules get imported.

The plugin registers in every vLLM process; importing the model runners there (the frontend,
the model-inspection subprocess) would cost time for nothing, so patches wait for the import.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from typing import Callable

_HOOKS: dict[str, list[Callable]] = {}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _HOOKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                _wrap_loader(spec.loader, fullname)
                return spec
        return None


def _wrap_loader(loader, fullname: str) -> None:
    orig = loader.exec_module

    def exec_module(module):
        orig(module)
        for fn in _HOOKS.pop(fullname, []):
            fn(module)

    loader.exec_module = exec_module


_FINDER = _Finder()


def when_imported(name: str, fn: Callable) -> None:
    """Call fn(module) once `name` is imported (now, if it already is)."""
    mod = sys.modules.get(name)
    if mod is not None and getattr(mod, "__spec__", None) is not None and name not in _HOOKS:
        fn(mod)
        return
    _HOOKS.setdefault(name, []).append(fn)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def wrap_method(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace cls.name by make(original), once. Only attributes cls defines itself."""
    orig = cls.__dict__.get(name)
    if orig is None or getattr(orig, "__vllm_hook__", False):
        return
    new = functools.wraps(orig)(make(orig))
    new.__vllm_hook__ = True
    setattr(cls, name, new)
