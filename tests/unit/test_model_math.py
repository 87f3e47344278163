"""The in-model steering formula and capture scatter, against the documented formulas."""

from __future__ import annotations

import math

import numpy as np
import torch

from vllm_hook.delivery.store import RequestStore, points_from_bytes
from vllm_hook.model.steering import capture_rows, steer_delta


def tables(ops, H=16, K=2, slots=None):
    """ops: list of (coef5, vector). Op i+1 holds u.u with the ops listed in slots[i] (earlier
    ops of the same row and layer), as the runtime computes it at admission."""
    n = len(ops)
    op_prm = torch.zeros(n + 1, 4 + K)
    op_prm[0, :5] = torch.tensor([0, 0, 0, -math.inf, math.inf])
    op_vid = torch.arange(n + 1)
    unit = torch.zeros(n + 1, H)
    for i, (_c, v) in enumerate(ops, 1):
        unit[i] = v / v.norm()
    for i, (c, v) in enumerate(ops, 1):
        gram = [float(unit[i] @ unit[j]) for j in (slots or {}).get(i, [])]
        op_prm[i] = torch.tensor([c[0] * float(v.norm()), *c[1:], *gram, *[0.0] * (K - 1 - len(gram))])
    return op_prm, op_vid, unit


def test_identity_is_exactly_zero():
    h = torch.randn(5, 16) * 100
    op_prm, op_vid, unit = tables([])
    d = steer_delta(h, torch.zeros(8, 2, dtype=torch.int64), op_prm, op_vid, unit, 2)
    assert torch.equal(d, torch.zeros_like(h))


def test_each_formula_and_order():
    torch.manual_seed(0)
    H = 16
    h = torch.randn(3, H, dtype=torch.float64).float()
    v1, v2 = torch.randn(H), torch.randn(H)
    u1, u2 = v1 / v1.norm(), v2 / v2.norm()
    inf = math.inf
    ops = [([2.0, 0, 0, -inf, inf], v1),      # add
           ([0, 0.5, 0, -inf, inf], v2),      # norm-matched add
           ([0, 0, 0, -0.1, 0.2], v1),        # cap
           ([0, 0, -1.0, -inf, inf], v2)]     # ablate (scale 0)
    op_prm, op_vid, unit = tables(ops, H, slots={3: [1], 4: [2]})
    # Row 0: op1 then op3 at one layer; row 1: op2 then op4; row 2: nothing.
    idx = torch.tensor([[1, 3], [2, 4], [0, 0]] + [[0, 0]] * 5)
    d = steer_delta(h, idx, op_prm, op_vid, unit, 2)
    x = h[0] + 2.0 * v1
    p = x @ u1
    x = x + (p.clamp(-0.1, 0.2) - p) * u1
    assert torch.allclose(h[0] + d[0], x, atol=1e-5)
    y = h[1] + 0.5 * h[1].norm() * u2
    y = y - (y @ u2) * u2
    assert torch.allclose(h[1] + d[1], y, atol=1e-5)
    assert abs(float((h[1] + d[1]) @ u2)) < 1e-5
    assert torch.equal(d[2], torch.zeros(H))


def test_capture_rows_scatter():
    pool = torch.zeros(10, 4)
    x = torch.arange(12.0).view(3, 4)
    idx = torch.tensor([8, 0, 9, 9, 9])
    capture_rows(x, idx, pool)
    assert torch.equal(pool[0], x[1]) and torch.equal(pool[8], x[0])


def test_store_newest_copy_wins_and_roundtrip():
    s = RequestStore()
    s.add(0, np.array([0, 1, 2]), torch.tensor([[0.0], [1.0], [2.0]]), last_only=False)
    s.add(0, np.array([2, 3]), torch.tensor([[20.0], [3.0]]), last_only=False)   # recompute of 2
    pts, meta = points_from_bytes(s.to_bytes({"errors": ["x"]}))
    pos, rows = pts[0]
    assert pos.tolist() == [0, 1, 2, 3] and rows.flatten().tolist() == [0.0, 1.0, 20.0, 3.0]
    assert meta == {"errors": ["x"]}


def test_store_last_only_keeps_two_newest():
    s = RequestStore()
    for p in range(5):
        s.add(1, np.array([p]), torch.tensor([[float(p)]]), last_only=True)
    pos, rows = s.points()[1]
    assert pos.tolist() == [3, 4]
