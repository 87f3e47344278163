"""Operator hooks a test server installs (additional_config vllm_hook.hook_modules)."""

from __future__ import annotations

import vllm_hook


@vllm_hook.operator_hook("scale_stream")
def scale_stream(layers: list[int], factor: float = 1.5) -> vllm_hook.Hook:
    """Multiply the residual stream by `factor` after `layers` (a modifying hook)."""
    return vllm_hook.Hook(lambda ctx, h: h * factor, layers, name="scale_stream",
                          args={"layers": layers, "factor": factor})


@vllm_hook.operator_hook("raise_after")
def raise_after(layers: list[int], calls: int = 2) -> vllm_hook.Hook:
    """Raise ValueError on the request's `calls`-th call (a broken hook)."""
    def fn(ctx, h):
        n = ctx.saved["calls"] = ctx.saved.get("calls", 0) + 1
        if n >= calls:
            raise ValueError(f"deliberate failure on call {n}")
        return None
    return vllm_hook.Hook(fn, layers, name="raise_after", args={"layers": layers, "calls": calls})
