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


def test_a_spec_dict_is_serialised_once_while_unchanged():
    """`spec_json` keeps the text of a plain spec dict passed again (a batch sharing one spec);
    one changed in place, or holding a tensor, is serialised anew."""
    import json

    import torch

    from vllm_hook.client import _TEXTS, spec_json

    spec = {"steer": [{"op": "add", "layer": i, "vector": "v", "scale": 0.5} for i in range(4)]}
    first = spec_json(spec)
    assert spec_json(spec) is first and json.loads(first) == spec
    spec["steer"][2]["scale"] = 2.0                      # changed in place: not the old text
    assert json.loads(spec_json(spec))["steer"][2]["scale"] == 2.0
    assert spec_json(dict(spec)) == spec_json(spec)      # an equal dict: the same text
    t = {"steer": [{"op": "add", "layer": 0, "vector": torch.ones(3)}]}
    assert json.loads(spec_json(t))["steer"][0]["vector"]["b64"] and _TEXTS.get(t) is None
    for i in range(3 * _TEXTS.SIZE):                     # bounded
        spec_json({"capture": [{"layers": [i]}]})
    assert len(_TEXTS._by_id) <= _TEXTS.SIZE
