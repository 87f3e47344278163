"""benchmarks/profile_batches.py's arithmetic over py-spy's raw stacks (no engine, no py-spy)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import profile_batches as pb  # noqa: E402


def test_frames_count_each_frame_once_per_stack_and_grown_orders_by_growth(tmp_path):
    hooked, unhooked = tmp_path / "h.txt", tmp_path / "u.txt"
    # A recursive frame counts once per stack; line numbers are dropped (one row per function).
    hooked.write_text("main (a.py:1);step (a.py:5);step (a.py:9) 6\nmain (a.py:1);encode (b.py:3) 4\n\n")
    unhooked.write_text("main (a.py:2);step (a.py:5) 5\n")
    incl, total = pb.frames(hooked)
    assert total == 10 and incl["main (a.py)"] == 10 and incl["step (a.py)"] == 6 and incl["encode (b.py)"] == 4
    rows = pb.grown(hooked, unhooked, per_sample_us=2.0)
    assert [(r[3], r[0]) for r in rows] == [("main (a.py)", 10.0), ("encode (b.py)", 8.0), ("step (a.py)", 2.0)]
    assert pb.frames(tmp_path / "missing.txt") == ({}, 0)      # a py-spy that sampled nothing
