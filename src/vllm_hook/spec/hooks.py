"""The `hooks` items of a spec: checked against the engine and turned into wire entries.

An item is a `vllm_hook.Hook` (offline: pickled for the workers), `{"name": ..., "args":
{...}}` (an operator hook, `hooks/registry.py`), or `{"pickle": <base64 cloudpickle of a
Hook>}`, which a server accepts only when the operator set `allow_client_code`.
"""

from __future__ import annotations

import base64
import json
import weakref
from typing import Any

from ..hooks import registry
from ..hooks.hook import Hook, digest, unpickle_hook
from .errors import SpecError

_PICKLED: "weakref.WeakKeyDictionary[Hook, tuple[bytes, str]]" = weakref.WeakKeyDictionary()
NO_CLIENT_CODE = ("call an operator hook by name instead ({\"name\": ..., \"args\": {...}}; "
                  "GET /v1/hook/health lists them), or have the operator start the engine with "
                  "additional_config vllm_hook.allow_client_code=true, which lets clients run "
                  "code on the server")


def _pickled(hook: Hook) -> tuple[bytes, str]:
    """A Hook object's pickle, made once per object (a batch shares one)."""
    got = _PICKLED.get(hook)
    if got is None:
        data = hook.pickled()
        got = _PICKLED[hook] = (data, digest(data))
    return got


def pickled_entry(hook: Hook) -> dict:
    data, dg = _pickled(hook)
    return {"pickle": data, "digest": dg}


def _from_item(item: Any, where: str, allow_pickles: bool) -> tuple[Hook, dict]:
    if isinstance(item, Hook):
        return item, pickled_entry(item)
    name = getattr(item, "name", None)
    if name is not None:
        args = dict(item.args or {})
        try:
            hooks = registry.build(name, args)
        except KeyError:
            raise SpecError(f"{where}.name", f"no operator hook named {name!r}",
                            f"use one of {sorted(registry.available())} (GET /v1/hook/health "
                            "lists them), or install it (additional_config vllm_hook.hook_modules)") from None
        except registry.HookArgsError as e:
            raise SpecError(f"{where}.args", str(e), f"pass the arguments operator hook {name!r} "
                            "takes (GET /v1/hook/health lists them)") from None
        except Exception as e:
            raise SpecError(f"{where}.args", f"operator hook {name!r} refused its arguments: {e}",
                            "fix the arguments") from None
        if len(hooks) != 1:
            raise SpecError(where, f"operator hook {name!r} made {len(hooks)} hooks", "one name, one hook")
        blob = json.dumps([name, args], sort_keys=True, default=str).encode()
        return hooks[0], {"name": name, "args": args, "digest": digest(blob)}
    if not allow_pickles:
        raise SpecError(where, "this server does not run client-supplied Python hooks", NO_CLIENT_CODE)
    raw = item.pickle
    try:
        data = raw if isinstance(raw, (bytes, bytearray)) else base64.b64decode(raw, validate=True)
        hook = unpickle_hook(bytes(data))
    except Exception as e:
        raise SpecError(f"{where}.pickle", f"not a pickled vllm_hook.Hook ({type(e).__name__}: {e})",
                        "send base64(cloudpickle.dumps(vllm_hook.Hook(...)))") from None
    return hook, {"pickle": bytes(data), "digest": digest(bytes(data))}


def resolve_hooks(items: list, num_layers: int, hook_layers: set[int], allow_pickles: bool,
                  modules: tuple[str, ...] = ()) -> list[dict]:
    """The wire entries of a spec's hooks: i (spec index), layers (non-negative), pre,
    batched, digest, and the pickle or the name and arguments."""
    registry.load(modules)
    out = []
    for i, item in enumerate(items):
        where = f"hooks[{i}]"
        hook, entry = _from_item(item, where, allow_pickles)
        layers = []
        for L in hook.layer_indices:
            if not -num_layers <= L < num_layers:
                raise SpecError(f"{where}.layer_indices", f"layer {L} is out of range for a "
                                f"{num_layers}-layer model", f"use 0..{num_layers - 1}, or -1..-{num_layers}")
            L %= num_layers
            if L not in hook_layers:
                where_ok = f"(hook layers: {sorted(hook_layers)})" if hook_layers else "(it has none)"
                raise SpecError(f"{where}.layer_indices", f"layer {L} has no hook point in this "
                                f"engine {where_ok}", "start the engine with additional_config "
                                f'vllm_hook.hook_layers including {L} (or "all")')
            layers.append(L)
        out.append({**entry, "i": i, "layers": layers, "pre": bool(hook.pre), "batched": bool(hook.batched)})
    return out
