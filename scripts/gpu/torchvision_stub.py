"""torchvision in the vLLM 0.33 GPU kit (site/torchvision/__init__.py): the image's torchvision is
built for its torch 2.11 and fails beside torch 2.14, yet transformers and vLLM 0.33's warm-up
import names from it (`InterpolationMode`, `pil_to_tensor`, `io`, `transforms.v2`). Text models
never call them: every missing submodule and name is a placeholder that raises when called."""

import enum
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _Any:
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        raise NotImplementedError("torchvision is a stub in the vllm-hook GPU kit for vLLM 0.33")

    def __getattr__(self, n):
        if n.startswith("__"):
            raise AttributeError(n)
        return _Any()


class _Module(types.ModuleType):
    def __getattr__(self, n):
        if n.startswith("__"):
            raise AttributeError(n)
        return InterpolationMode if n == "InterpolationMode" else _Any()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


sys.meta_path.append(_Finder())


def __getattr__(n):
    if n.startswith("__"):
        raise AttributeError(n)
    return importlib.import_module(f"{__name__}.{n}")
