"""A batched hook's per-step group (worker/hooks.py), without an engine: rows in row order
whatever order the requests were planned in, and a request whose hook failed at an earlier
layer is left out of the later calls of the step."""

import torch

from vllm_hook.config import HookConfig
from vllm_hook.hooks.hook import Hook
from vllm_hook.worker.hooks import WorkerHooks


class _Access:
    def __call__(self, name):
        raise KeyError(name)


def test_group_rows_and_a_failure_between_layers():
    wh = WorkerHooks(_Access(), 4, {2, 3}, HookConfig(hook_layers="all"), 1e4)
    seen = []

    def fn(ctx, h):
        seen.append((ctx.layer_idx, [c.request_id for c in ctx.requests], ctx.segments, h[:, 0].tolist()))

    hook = Hook(fn, [1, 2], batched=True)
    wh._built["d"] = hook
    reqs = {rid: wh.for_request(rid, 8, [{"i": 0, "digest": "d"}], []) for rid in ("a", "b", "c")}
    hs, res = torch.arange(6.0)[:, None].repeat(1, 4), torch.zeros(6, 4)
    # planned out of row order: c (rows 4-5), a (row 0), b (rows 1-3)
    wh.plan([(reqs["c"], 4, 2, 8), (reqs["a"], 0, 1, 8), (reqs["b"], 1, 3, 8)])
    wh.run(2, hs, res)                                       # after layer 1
    reqs["b"].spec[0].fail("test")                           # b's hook fails between the layers
    wh.run(3, hs, res)                                       # after layer 2
    assert seen[0] == (1, ["a", "b", "c"], [(0, 1), (1, 3), (4, 2)], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    assert seen[1] == (2, ["a", "c"], [(0, 1), (1, 2)], [0.0, 4.0, 5.0])
    assert reqs["b"].spec[0].errors == ["hook 0: test; it runs no more for this request"]
