"""`Hook`: user Python code that runs inside the forward pass, per request.

Compatible in spirit and names with vllm-lens: `Hook(fn, layer_indices=[...], pre=False)`,
`fn(ctx, h) -> Tensor | None`. A hook travels to the workers pickled (cloudpickle) when it
is a Python object, or by name with JSON arguments when the operator installed it
(`hooks/registry.py`); served mode accepts pickles only with `allow_client_code`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


@dataclass(frozen=True, eq=False)
class Hook:
    """Run `fn(ctx, h)` at `layer_indices` for every forward pass of a request.

    `h` is the request's own rows of the residual stream ([rows, hidden], a fresh tensor in
    the model's dtype): after the layer (`pre=False`), or the layer's input (`pre=True`; for
    layer 0 the embeddings). Returning a tensor of the same shape replaces those rows (the
    whole stream: a hook that returns zeros leaves exactly zeros downstream); `None` leaves
    them. `ctx.saved` persists across layers and steps of the request and comes back as its
    `Results.hook_results[i]`.

    `batched=True`: `fn` is called once per layer and step for every request in the batch
    that uses this same hook, with `h` the rows of all of them (`ctx` is then a
    `BatchHookContext`): one call instead of one per request, which is what makes a hook that
    multiplies by a large matrix (a logit lens) cheap at 64 requests.

    `read_only=True`: `fn` never returns a tensor (returning one is an error for its
    request). Under CUDA graphs a decode step whose hooks are all read-only replays one
    graph that copies the stream at the hook points, and the hooks run after it on those
    copies, in layer order: no graph breaks (`docs/hooks.md`, "Where hooks run").

    `graphable=True` (with `batched` and `read_only`): `fn` launches the same device work on
    the same rows at every step of a steady batch (no Python that depends on positions or
    values, no host synchronisation, results only through `ctx.save`). Such steps then replay
    the hooks' kernels from a CUDA graph of their own, one launch instead of one per kernel
    (`worker/hook_graphs.py`).
    """

    fn: Callable[..., Any]
    layer_indices: Sequence[int]
    pre: bool = False
    batched: bool = False
    name: str | None = None
    args: dict = field(default_factory=dict)   # the JSON arguments of a named hook
    read_only: bool = False
    graphable: bool = False

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Hook.fn must be callable, got {type(self.fn).__name__}")
        layers = list(self.layer_indices) if not isinstance(self.layer_indices, int) else [self.layer_indices]
        if not layers or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
            raise ValueError("Hook.layer_indices must be a non-empty list of integer layer indices")
        object.__setattr__(self, "layer_indices", tuple(layers))

    def __deepcopy__(self, memo) -> "Hook":
        # vLLM deep-copies every request's SamplingParams: one Hook object shared by a batch
        # stays one object (pickled once, one batched call), as the user made it.
        return self

    def __copy__(self) -> "Hook":
        return self

    def pickled(self) -> bytes:
        import cloudpickle

        return cloudpickle.dumps(self)


def unpickle_hook(data: bytes) -> Hook:
    import cloudpickle

    hook = cloudpickle.loads(data)
    if not isinstance(hook, Hook):
        raise TypeError(f"the pickled object is a {type(hook).__name__}, not a vllm_hook.Hook")
    return hook


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]
