"""The two clients offer the same methods, and docs/serve.md lists them all."""

import inspect
import re
from pathlib import Path

import vllm_hook


def _public(cls) -> set[str]:
    return {n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")} - {"close", "aclose"}


def test_sync_and_async_clients_have_the_same_methods_as_documented():
    sync, asyn = _public(vllm_hook.Client), _public(vllm_hook.AsyncClient)
    assert sync == asyn
    doc = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text()
    listed = set(re.findall(r"`(\w+)`", doc[doc.index("Methods: "):].split("\n\n")[0]))
    assert listed == sync, (sorted(sync - listed), sorted(listed - sync))
