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


def test_a_report_says_when_its_host_is_slow_or_unsteady():
    """`run.host_line`: a GPU report's sentence on its host (the probe's min / median / max);
    slower than run 133's steady host, or unsteady, is flagged as a diagnostic run."""
    from run import STEADY_PROBE_MS, host_line

    def line(*ms):
        return host_line({"host": {"python_loop_ms": list(ms)}})

    assert "diagnostic" not in line(12.84, 13.06, 13.16) and "13.06" in line(12.84, 13.06, 13.16)
    assert "diagnostic" in line(26.23, 26.56, 26.89)                  # slow (run 137)
    assert "diagnostic" in line(14.1, 19.94, 22.36)                   # unsteady
    assert "diagnostic" in line(STEADY_PROBE_MS, 1.2 * STEADY_PROBE_MS, 1.3 * STEADY_PROBE_MS)
    assert host_line({}) == ""                                        # results before the probe
