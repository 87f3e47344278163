"""One payload per fetch (`delivery.store.batch_to_wire`): every request's results equal what
its own payload gives, bit for bit, whatever is packed and whatever keeps its own entry."""

from __future__ import annotations

import numpy as np
import torch

from vllm_hook.config import HookConfig
from vllm_hook.delivery import spill
from vllm_hook.delivery.store import PACK_BELOW, RequestStore, batch_to_wire, parse_batch
from vllm_hook.hooks.state import encode
from vllm_hook.model.layout import PointTable
from vllm_hook.results import build

CFG = HookConfig(sites=("resid_post", "resid_pre"))
TABLE = PointTable.for_config(4, CFG)
H = 16


def _request(j: int, big: bool):
    g = torch.Generator().manual_seed(j)
    s = RequestStore()
    P = 5 + j
    s.add((0, 2), np.arange(P), torch.randn(2 * P, H, generator=g), False)             # prompt chunk
    for step in range(3):
        s.add((0, 2), np.array([P + step]), torch.randn(2, H, generator=g), False)      # decode rows
    if big:                                  # larger than PACK_BELOW: its own entry
        rows = PACK_BELOW // (4 * H) + 4
        s.add((3,), np.arange(rows), torch.randn(rows, H, generator=g), False)
    tensors, structure = encode([{"ids": [torch.arange(j + 1)], "x": float(j)}], "hk")
    meta = {"req_id": f"r{j}", "errors": [f"e{j}"] if j % 2 else [], "rank": 0, "hooks": structure}
    items = [{"site": "resid_post", "layer": L, "sel": "all", "pos": []} for L in (0, 2)]
    if big:
        items.append({"site": "resid_post", "layer": 3, "sel": "prompt", "pos": []})
    return s, meta, tensors, items, P


def _same(a, b):
    assert a.errors == b.errors and a.token_ids == b.token_ids
    for site in b.activations:
        for L in b.activations[site]:
            assert torch.equal(a.activations[site][L], b.activations[site][L])
            assert torch.equal(a.positions[site][L], b.positions[site][L])
    assert len(a.hook_results) == len(b.hook_results)
    for x, y in zip(a.hook_results, b.hook_results):
        assert x["x"] == y["x"] and torch.equal(x["ids"][0], y["ids"][0])


def test_batch_payload_equals_per_request_payloads(tmp_path):
    reqs = [_request(j, big=j in (1, 4)) for j in range(6)]
    alone = []
    for s, meta, tensors, items, P in reqs:
        blob = s.to_bytes(meta, tensors)
        alone.append(build(blob, items, TABLE, request_id="x", prompt_token_ids=list(range(P)),
                           output_token_ids=[1, 2, 3, 4], hooks=1))
    parts = [(meta, s._tensors(tensors)) for s, meta, tensors, _, _ in reqs]
    for target in (None, spill.spill_target(str(tmp_path))):     # the RPC's bytes, a shared file
        wire = batch_to_wire(parts, target)
        assert ("path" in wire) == (target is not None)
        buf = spill.open_entry(wire)
        parsed = parse_batch(buf)
        assert len(parsed) == len(reqs)
        for (pts, meta), (_, _, _, items, P), ref in zip(parsed, reqs, alone):
            got = build([(pts, meta, isinstance(buf, torch.Tensor))], items, TABLE, request_id="x",
                        prompt_token_ids=list(range(P)), output_token_ids=[1, 2, 3, 4], hooks=1)
            _same(got, ref)
