"""The worker's check of a wire's steering columns (`worker.wire.check_wire`): every malformed
value names the op and what is wrong, whether the ops came packed or as a hand-made list."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_hook.config import HookConfig
from vllm_hook.model.layout import PointTable
from vllm_hook.spec.resolve import coefficients, pack_steer, steer_ops, unpack_steer
from vllm_hook.worker.wire import check_coefficients, check_wire

L, H = 4, 8
POINTS = PointTable.for_config(L, HookConfig())
OK = {"layer": 1, "sel": "all", "pos": [], "c": [1.0, 0.0, 0.0, -math.inf, math.inf], "digest": "d", "name": "v"}


def check(ops: list[dict]) -> None:
    check_wire({"P": 8, "steer": unpack_steer(ops)}, L, H, POINTS)


def test_packed_and_hand_made_ops_read_the_same():
    ops = [OK, {**OK, "layer": 3, "sel": "pos", "pos": [2, 5], "name": None,
                "vec": np.ones(H, np.float32).tobytes()}]
    blob = pack_steer(unpack_steer(ops))
    packed = unpack_steer(blob)
    assert {**packed, "c": None} == {**unpack_steer(ops), "c": None}
    assert coefficients(packed["c"]) == OK["c"] * 2         # flat, five an op, float64 bytes
    assert np.frombuffer(packed["c"]).tolist() == OK["c"] * 2
    assert steer_ops(blob)[1]["pos"] == [2, 5]
    check(ops)
    check_wire({"P": 8, "steer": packed}, L, H, POINTS)


@pytest.mark.parametrize("bad, words", [
    ({"layer": L}, "not integers in [0, 4)"),
    ({"layer": "1"}, "not integers"),
    ({"c": [math.nan, 0.0, 0.0, 0.0, 0.0]}, "coefficients"),
    ({"c": [math.inf, 0.0, 0.0, 0.0, 0.0]}, "coefficients"),
    ({"c": [1.0, 0.0, 0.0, 0.0]}, "coefficients"),
    ({"c": None}, "coefficients"),
    ({"sel": "some"}, "steering op 1: unknown selector 'some'"),
    ({"sel": "pos", "pos": [-1]}, "steering op 1 position -1"),
    ({"pos": None}, "steering op 1: positions are not a list"),
    ({"digest": None}, "digest"),
    ({"name": None}, "steering op 1: neither a vector nor a registered name"),
    ({"name": None, "vec": b"\0" * 3}, "steering op 1: vector of 3 bytes, expected 32"),
])
def test_malformed_steering_ops(bad, words):
    with pytest.raises(ValueError) as e:
        check([OK, {**OK, **bad}])
    assert words in str(e.value)


def test_columns_of_different_lengths():
    cols = unpack_steer([OK, OK])
    cols["sel"] = ["all"]
    with pytest.raises(ValueError, match="malformed"):
        check_wire({"P": 8, "steer": cols}, L, H, POINTS)


@pytest.mark.parametrize("c", [b"\x00" * 7, b"\x00" * 32, np.array([math.nan, 0, 0, 0, 0]).tobytes(),
                               np.array([0, 0, math.inf, 0, 0]).tobytes()])
def test_malformed_coefficient_bytes(c):
    with pytest.raises(ValueError, match="malformed|coefficients"):
        check_coefficients(c, 1)
    assert check_coefficients(np.array([1, 0, 0, -math.inf, math.inf]).tobytes(), 1).shape == (1, 5)


@pytest.mark.parametrize("m", [0, -1, "3", True, 2.0, None])
def test_a_max_tokens_that_is_not_a_positive_integer_is_refused(m):
    """The wire's "M" (the request's max_tokens, `frontend.admission`) bounds its routes."""
    check_wire({"P": 8, "M": 5}, L, H, POINTS)
    with pytest.raises(ValueError, match="max_tokens"):
        check_wire({"P": 8, "M": m}, L, H, POINTS)


@pytest.mark.parametrize("w", [2, -1, "1", True, 1.0, None])
def test_a_float32_flag_that_is_not_0_or_1_is_refused(w):
    """The wire's "W" (rows widened on the device, `frontend.admission._widen_on_device`)."""
    check_wire({"P": 8, "W": 1}, L, H, POINTS)
    with pytest.raises(ValueError, match="float32 flag"):
        check_wire({"P": 8, "W": w}, L, H, POINTS)
