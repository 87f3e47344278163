"""The GPU benchmark suite, on the CPU with the tiny model: it runs end to end and writes its
table. A smoke check only: no timing is asserted (two engines share 2 cores here). Each
engine runs its core in its own worker process (conftest's VLLM_ENABLE_V1_MULTIPROCESSING=0
reaches the scripts): a second process per engine would double every start-up here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[1]


def _script(name: str, *args, timeout: int = 1500) -> subprocess.CompletedProcess:
    """benchmarks/`name` run with `args`; asserted to succeed (its output's tail if not)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_benchmark_suite_smoke(tmp_path, engines):
    engines.close()                      # the four engine processes get the CPU
    _script("run.py", "--smoke", "--suite", "bench", "--in-engine", "--out", tmp_path)
    r = json.loads((tmp_path / "results.json").read_text())
    assert set(r["startup"]) == {"native_graph", "plugin_lean", "plugin_full", "plugin_capture_only"}
    workloads = {x["workload"] for x in r["bench"]["tpot"]}
    assert {"unused", "steer_add_1_layer", "cap_1_layer", "capture_all_tokens_all_layers",
            "mixed_thirds", "attention_tracker_4_layers", "unused_capture_only_engine"} <= workloads
    assert all(x["method"] == "step" for x in r["bench"]["tpot"])   # the engine core's step timestamps
    # --in-engine: every row also timed the same batch unhooked on its plugin engine (for the
    # `unused` rows, the estimator's null control)
    assert all("plugin_unused_s" in x for x in r["bench"]["tpot"])
    assert all(x["capture_bytes"] > 0 for x in r["bench"]["capture_e2e"])
    report = (tmp_path / "report.md").read_text()
    assert "| unused | plugin_lean |" in report and "attention_tracker_4_layers" in report
    pooled = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pool.py"), str(tmp_path / "results.json")],
                            capture_output=True, text=True, timeout=120)
    assert pooled.returncode == 0, pooled.stderr[-3000:]
    assert "| mixed_thirds | 2 | 1 |" in pooled.stdout


def test_throughput_and_hook_benchmarks_smoke(tmp_path, engines):
    """benchmarks/throughput.py, extract_speed.py and async_fetch.py (issue 17) and
    hooks_gpu.py (issue 16) on the tiny model."""
    engines.close()
    # --one-params: the uniform workloads as users pass them (one SamplingParams), mixed as before;
    # --varied-lengths: prompts of many lengths, as a dataset's
    for script, extra in (("throughput.py", ["--workloads", "unused", "steer_add_all_layers", "mixed_thirds",
                                             "steer_add_all_layers_own_scale", "--one-params", "--varied-lengths"]),
                          ("hooks_gpu.py", []), ("extract_speed.py", []), ("async_fetch.py", [])):
        out = tmp_path / script
        _script(script, "--smoke", "--out", out, *extra)
        assert (out / "report.md").read_text().count("|") > 20
    tp = json.loads((tmp_path / "throughput.py" / "results.json").read_text())
    assert {c["workload"] for c in tp["cases"]} >= {"unused", "steer_add_all_layers", "capture_all_tokens_all_layers",
                                                   "steer_add_all_layers_own_scale"}
    assert all(c["host_us_per_request"]["admission (parse, resolve)"] > 0 for c in tp["cases"] if c["workload"] != "unused")
    assert tp["varied_lengths"] and tp["one_params"] and "lengths spread" in (tmp_path / "throughput.py" / "report.md").read_text()
    hk = json.loads((tmp_path / "hooks_gpu.py" / "results.json").read_text())
    assert hk["parity"]["modifying_hook_zeroed_dims_exactly"] is True
    af = json.loads((tmp_path / "async_fetch.py" / "results.json").read_text())
    assert all(set(r) == {"hooked", "unhooked", "late"} for c in af["cases"] for r in c["reps"]) and af["cases"]
    xs = json.loads((tmp_path / "extract_speed.py" / "results.json").read_text())
    assert [c["job"] for c in xs["cases"]] == ["last_prompt_4_layers", "all_tokens_4_layers_bf16"]
    assert all(c["bytes"] > 0 and c["extract_tok_s"] > 0 for c in xs["cases"])


def test_widen_check_smoke(tmp_path, engines):
    """benchmarks/widen_check.py (issue 17) on the tiny model in bf16 exits 0 (its checks:
    rows widened on the device are the model dtype's rows widened, in a float32 batch and a
    mixed one; the first batch's rows, lent from the arena and held, do not change while later
    batches run). On the CPU the rows of every batch came out equal bit for bit."""
    engines.close()
    out = tmp_path / "widen"
    _script("widen_check.py", "--smoke", "--out", out, timeout=900)
    got = json.loads((out / "check.json").read_text())
    assert got["first_batch_pieces_lent"] > 0 and got["wrong_place_rel_min"] > 0.5
    assert (got["all_float32"]["requests"], got["mixed_with_model_dtype"]["requests"]) == (24, 12)
    for g in (got["all_float32"], got["mixed_with_model_dtype"], got["mixed_with_model_dtype"]["model_dtype_requests"]):
        assert g["equal"] == g["requests"], g


def test_uva_probe_smoke(tmp_path):
    """benchmarks/uva_probe.py (issue 17) on the CPU: rows scattered into per-request regions
    equal the rows they came from, in bf16 and widened to float32."""
    out = tmp_path / "uva"
    _script("uva_probe.py", "--smoke", "--out", out, timeout=300)
    got = json.loads((out / "uva.json").read_text())
    assert all(got["regions_equal"].values()) and got["host_join_float32_us_per_request"] > 0


def test_served_delivery_benchmark_smoke(tmp_path):
    """benchmarks/served_delivery.py (issue 17): the plugin's routes and store in a uvicorn
    process, results read by `AsyncClient` from their files and over HTTP (it asserts each
    comes back whole, and that the entries say "local" only where asked)."""
    out = tmp_path / "sd.json"
    _script("served_delivery.py", "--results", "4", "--rows", "16", "--hidden", "64", "--rounds", "1",
            "--out", out, timeout=300)
    got = json.loads(out.read_text())
    assert got["from_files"]["wall_ms_per_result"] > 0 and got["over_http"]["wall_ms_per_result"] > 0
    assert got["from_files"]["offered_as_files"] == 4


def test_served_throughput_benchmark_smoke(tmp_path, engines):
    """benchmarks/throughput_served.py (issue 17): a native and a plugin `vllm serve`, each rep
    native, plugin, native, plugin."""
    engines.close()
    out = tmp_path / "tps"
    _script("throughput_served.py", "--smoke", "--workloads", "unused", "mixed_thirds", "--batches", "8x16+4",
            "--reps", "2", "--deliveries", "files", "http", "--out", out)
    r = json.loads((out / "results.json").read_text())
    # each workload with a client reading result files, then one fetching them over HTTP
    assert [(c["workload"], c["delivery"]) for c in r["cases"]] == [
        ("unused", "files"), ("unused", "http"), ("mixed_thirds", "files"), ("mixed_thirds", "http")]
    for c in r["cases"]:
        for x in c["reps"]:      # each batch's time, the client's collector time and CPU times
            assert {"native_s", "hooked_s", "unhooked_s", "delivered_bytes", "hooked_gc_s",
                    "unhooked_gc_s"} <= set(x) and len(x["hooked_cpu_s"]) == 3, x
        assert set(c["cpu_us_per_request"]) == {"api_server", "engine", "client"}
        # the plugin server's collector a batch (its counters, `gc_s`): API process, rank 0's
        assert all(len(x["hooked_server_gc_s"]) == 2 for x in c["reps"]) and set(c["server_gc_ms"]) == {
            "api_server", "engine"}
    # 8 requests x 16 + 4 tokens: the all-token third's 4 layers of 128 floats, counted client-side
    assert r["cases"][0]["delivered_mb"] == 0 and r["cases"][2]["delivered_mb"] == r["cases"][3]["delivered_mb"] > 0
    mixed = r["cases"][2]["host_us_per_request"]
    assert mixed["admission (parse, resolve)"] > 0 and mixed["encode (safetensors; inline or a handle)"] > 0
    report = (out / "report.md").read_text()
    assert "| mixed_thirds | 8 | 16 + 4 |" in report and "| mixed_thirds (over HTTP) | 8 | 16 + 4 |" in report and "| API server | engine core and workers | client | collector" in report
    # the host's single-thread speed and load, so runs on different lent hosts can be told apart
    assert len(r["meta"]["host"]["python_loop_ms"]) == 3 and r["meta"]["host"]["cpus"] >= 1
    assert "Host probe" in report


def test_api_server_cpu_benchmark_smoke(tmp_path, engines):
    """benchmarks/api_server_cpu.py (issue 17): the API server's CPU per plain and steered
    request, rounds alternating, on one plugin `vllm serve`."""
    engines.close()
    out = tmp_path / "asc"
    proc = _script("api_server_cpu.py", "--requests", "24", "--rounds", "2", "--in-flight", "12", "--batches",
                   "--out", out)
    r = json.loads((out / "result.json").read_text())
    assert [len(r["rounds"][k]) for k in ("plain", "steer_add_all_layers")] == [2, 2]
    assert set(r["extra"]["steer_add_all_layers"]) == {"loop_us", "process_us", "client_us"}
    assert r["median"]["plain"]["loop_us"] > 0 and "+" in proc.stdout


def test_host_cost_microbenchmark_smoke(tmp_path):
    """Admission and delivery paths for 256 requests, no engine (issue 17)."""
    _script("host_cost.py", "--requests", "256", "--served", "--out", tmp_path / "host.json", timeout=600)
    r = json.loads((tmp_path / "host.json").read_text())
    for name, row in r.items():
        # The resolution cache: a batch sharing one spec resolves it once (a scale of each
        # request's own: every spec is new, timed as such)
        if name != "steer_add_all_layers_own_scale":
            assert row["frontend_admit_cached_us"] < row["frontend_admit_us"]
    # Served results travel in the model's dtype: half the bytes of float32 for the captures.
    cap = r["capture_all_tokens_4_layers"]
    assert cap["served_bytes_wire"] < 0.6 * cap["served_bytes_float32"]
    # Steering only: marked clean by the worker, delivered without a fetch; captures fetched.
    assert r["steer_add_all_layers"]["fetched_pct"] == 0 and cap["fetched_pct"] == 100
    assert r["steer_add_all_layers_own_scale"]["fetched_pct"] == 0


def test_host_profile_smoke(tmp_path, engines):
    """benchmarks/profile_host.py (issue 17) on the tiny model, its cases named (`--cases`): one
    profile per case, the plugin's counters beside it."""
    engines.close()
    _script("profile_host.py", "--smoke", "--out", tmp_path / "prof", "--cases", "steer_add_all_layers:4:2",
            timeout=900)
    text = (tmp_path / "prof" / "prof.txt").read_text()
    assert text.count("=====") == 1 and "steer_add_all_layers, 4 requests, 32 + 2 tokens" in text
    assert "plugin counters per profiled batch" in text


def test_parallel_benchmark_smoke(tmp_path, engines):
    """benchmarks/parallel.py (issue 21) with TP=2 and PP=2 on the tiny model: its check against
    TP=1 passes (fp32 here: every difference is summation order), hooks included, and its speed
    table is written."""
    engines.close()
    out = tmp_path / "par"
    _script("parallel.py", "--smoke", "--out", out)
    r = json.loads((out / "results.json").read_text())
    assert set(r["startup"]) == {f"{k}_{lay}" for k in ("native", "plugin") for lay in ("tp1", "tp2", "pp2")}
    for lay in ("tp2", "pp2"):
        assert r["check"][lay]["verdict"] == {"isolation_unhooked_unchanged_by_neighbours": True,
                                              "unhooked_like_native_within_tol": True, "steered_logprobs_within_tol": True,
                                              "captures_within_tol": True, "hooked_logprobs_within_tol": True,
                                              "modifying_hook_exact": True}, lay
        assert set(r["check"][lay]["capture_err_max_by_site"]) == {"resid_post", "q", "k", "attn_scores"}
        assert {x["workload"] for x in r["bench"][lay]} >= {"unused", "steer_add_all_layers", "mixed_thirds",
                                                           "python_hook_read_4_layers"}
        assert f"| {lay} | 4 | mixed_thirds |" in (out / "report.md").read_text()
