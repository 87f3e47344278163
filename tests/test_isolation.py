"""Isolation: a request's captures and steering affect that request only.

One batch of 11 concurrent requests with different specs (capture only, steering only, both,
none, attention internals, different layers, sites, selectors and lengths) gives every request the same tokens and
captures (<= 1e-5) as running it alone. Requests without a spec give the same tokens as an
engine with the plugin disabled (VLLM_HOOK_DISABLE=1, in a subprocess: a real no-op).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import vllm_hook

from tests.conftest import DEFAULTS
from tests.helpers.common import PROMPTS, ids_of, rel_err, res, run, sp, vec

pytestmark = pytest.mark.engine


@pytest.fixture
def llm(engines):
    return engines.get("qwen2-compiled", arch="qwen2")


def _specs():
    v1, v2 = vec(11).tolist(), vec(12).tolist()
    return [
        ({"capture": [{"layers": "all", "tokens": "all"}]}, 10),
        ({"steer": [{"op": "add", "layer": 1, "vector": v1, "scale": 5.0}]}, 12),
        (None, 6),
        ({"steer": [{"op": "cap", "layer": 2, "vector": v2, "min": -0.05, "max": 0.05}],
          "capture": [{"layers": [2, 3], "tokens": "generated"}]}, 9),
        ({"capture": [{"layers": [0], "site": "attn_out", "tokens": "last_prompt"},
                      {"layers": [3], "site": "mlp_out", "tokens": "last"}]}, 4),
        (None, 14),
        ({"steer": [{"op": "ablate", "layer": 0, "vector": v1}, {"op": "add", "layer": 3, "vector": v2,
                     "scale": 0.4, "norm_match": True}],
          "capture": [{"layers": [1], "site": "resid_pre", "tokens": [0, 2, -1]}]}, 11),
        ({"capture": [{"layers": [-1], "tokens": "prompt"}]}, 3),
        ({"steer": [{"op": "add", "layer": 2, "vector": v2, "scale": 7.0, "tokens": "generated"}],
          "capture": [{"layers": [2], "tokens": "all"}]}, 13),
        (None, 8),
        ({"capture": [{"site": "attn_scores", "layers": [1, 3], "tokens": "prompt"},
                      {"site": "q", "layers": [2], "heads": [0, 3]}, {"site": "k", "layers": [0]}]}, 7),
    ]


def test_mixed_batch_equals_each_request_alone(llm):
    specs = _specs()
    prompts = [ids_of(llm, PROMPTS[i % len(PROMPTS)]) for i in range(len(specs))]
    params = [sp(s, max_tokens=n) for s, n in specs]
    together = run(llm, prompts, params)
    steered_changed = 0
    for i, (p, prm) in enumerate(zip(prompts, params)):
        alone = run(llm, [p], [prm])[0]
        a, b = list(together[i].outputs[0].token_ids), list(alone.outputs[0].token_ids)
        assert a == b, f"request {i}: tokens differ in the batch"
        if specs[i][0] is None:
            assert not hasattr(together[i], "vllm_hook")
            continue
        ra, rb = res(together[i]), res(alone)
        for site in rb.activations:
            for L in rb.activations[site]:
                assert ra.positions[site][L].tolist() == rb.positions[site][L].tolist()
                assert rel_err(ra.activations[site][L], rb.activations[site][L]) <= 1e-5, (i, site, L)
        if "steer" in specs[i][0]:
            plain = run(llm, [p], [sp(None, max_tokens=specs[i][1])])[0]
            steered_changed += list(plain.outputs[0].token_ids) != a
    assert steered_changed >= 3


def test_unhooked_requests_match_plugin_disabled(llm):
    prompts = [ids_of(llm, p) for p in PROMPTS[:4]]
    hooked = run(llm, prompts + [prompts[0]],
                 [sp(None, max_tokens=10)] * 4 + [sp({"steer": [{"op": "add", "layer": 1,
                                                                "vector": vec(3).tolist(), "scale": 9.0}]})])
    env = {**os.environ, "VLLM_HOOK_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    kwargs = {k: v for k, v in DEFAULTS.items() if k != "additional_config"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.plain_generate", "qwen2", json.dumps(kwargs),
         json.dumps(prompts), "10"],
        env=env, capture_output=True, text=True, timeout=900,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stderr[-3000:]
    plain = json.loads(line[-1][7:])
    assert plain["patched"] is False and plain["has_results"] == [False] * 4
    assert plain["tokens"] == [list(o.outputs[0].token_ids) for o in hooked[:4]]


def test_requests_steering_alike_share_table_rows(llm):
    """A batch with one steering spec admits its ops once (issue 17: per-request cost)."""
    eng = llm.llm_engine
    ops = [{"op": "add", "layer": L, "vector": vec(60 + L).tolist(), "scale": 2.0} for L in range(4)]
    ids = ids_of(llm, PROMPTS[3])
    for n in range(6):
        eng.add_request(f"alike-{n}", {"prompt_token_ids": ids}, sp({"steer": ops}, max_tokens=4))
    eng.add_request("other", {"prompt_token_ids": ids}, sp({"steer": ops[:1]}, max_tokens=4))
    eng.step()
    s = vllm_hook.stats(llm)
    assert (s["ops_in_use"], s["vectors_in_use"]) == (4 + 1, 4), s
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    alike = {tuple(done[f"alike-{n}"].outputs[0].token_ids) for n in range(6)}
    assert len(alike) == 1
    run(llm, [ids], [sp(None, max_tokens=1)])
    s = vllm_hook.stats(llm)
    assert (s["ops_in_use"], s["vectors_in_use"]) == (0, 0), s


def test_requests_steering_alike_at_strengths_of_their_own(llm):
    """Issue 17: specs equal but for their steering numbers (a strength sweep) are resolved by
    their coefficients alone from the second of their shape on (`spec.rescale`), and the
    workers admit them from the shape the first left (`worker.steer_shapes`). Each request of
    such a batch steers and captures as when it is alone, resolved and admitted in full."""
    from tests.helpers.common import runtime
    from vllm_hook.frontend.state import state_of

    st = state_of(llm.llm_engine.input_processor)
    v = [vec(80 + L).tolist() for L in range(4)]

    def spec(s):
        return {"steer": [{"op": "add", "layer": L, "vector": v[L], "scale": s * (L + 1)} for L in range(3)]
                + [{"op": "cap", "layer": 3, "vector": v[3], "max": s / 10}],
                "capture": [{"layers": [3], "tokens": "last"}]}

    # the last two repeat strengths resolved from the template: exact hits in the frontend's
    # cache, steering shared on the workers with the earlier request at that strength
    scales = [0.5, 1.0, 2.0, -1.0, 3.0, -2.0, 2.0, -1.0]
    ids = [ids_of(llm, PROMPTS[i % len(PROMPTS)]) for i in range(len(scales))]
    st.resolved.clear()
    hits = st.resolved.hits
    together = run(llm, ids, [sp(spec(s), max_tokens=6) for s in scales])
    assert st.resolved._shapes and runtime(llm)._steer_shapes._shapes
    assert st.resolved.hits == hits + 2
    for i, s in enumerate(scales):
        st.resolved.clear()                      # the full way, frontend and worker
        runtime(llm)._steer_shapes.clear()
        alone = run(llm, [ids[i]], [sp(spec(s), max_tokens=6)])[0]
        assert list(together[i].outputs[0].token_ids) == list(alone.outputs[0].token_ids), s
        ra, rb = res(together[i]), res(alone)
        assert rel_err(ra.activations["resid_post"][3], rb.activations["resid_post"][3]) <= 1e-5, s
    assert len({tuple(o.outputs[0].token_ids) for o in together}) > 1


def test_one_spec_object_is_keyed_once_per_generate_call(llm, monkeypatch):
    """`LLM.generate` with one spec for many prompts pickles it for its cache key once per call
    (issue 17: per-request cost); the same dict edited between calls steers as edited."""
    from vllm_hook.frontend import cache

    keyed = []
    real = cache.cache_key
    monkeypatch.setattr(cache, "cache_key", lambda raw: keyed.append(1) or real(raw))
    ids = [ids_of(llm, p) for p in PROMPTS[:6]]
    spec = {"steer": [{"op": "add", "layer": 1, "vector": vec(70).tolist(), "scale": 4.0}]}
    first = [o.outputs[0].token_ids for o in run(llm, ids, sp(spec, max_tokens=4))]
    assert len(keyed) == 1
    spec["steer"][0]["scale"] = -4.0
    second = [o.outputs[0].token_ids for o in run(llm, ids, sp(spec, max_tokens=4))]
    assert len(keyed) == 2
    fresh = json.loads(json.dumps(spec))
    assert second == [o.outputs[0].token_ids for o in run(llm, ids, sp(fresh, max_tokens=4))]
    assert second != first


def test_steering_only_requests_are_delivered_without_a_fetch(llm):
    """Issue 17: a steering-only request has nothing to fetch unless a worker failed it. Its
    worker marks it clean in the arena the frontend has mapped (`delivery.arena`, clean
    marks), and the frontend delivers it with no fetch RPC. One that fails on the worker (a
    vector deleted after admission, before it ran) is still fetched, with its error, beside
    clean ones; the workers forget them all at their next step."""
    from vllm_hook.frontend.delivery import attach
    from vllm_hook.frontend.state import state_of

    ids = [ids_of(llm, p) for p in PROMPTS[:4]]
    steer = {"steer": [{"op": "add", "layer": 1, "vector": vec(71).tolist(), "scale": 4.0}]}
    run(llm, ids[:1], [sp({"capture": [{"layers": [0]}]}, max_tokens=2)])   # a fetch maps the arena
    before = vllm_hook.stats(llm)["frontend"]
    outs = run(llm, ids, sp(steer, max_tokens=4))
    after = vllm_hook.stats(llm)["frontend"]
    assert all(res(o).ok and res(o).token_ids == i + list(o.outputs[0].token_ids) for o, i in zip(outs, ids))
    assert after["fetches"] == before["fetches"]
    assert after["delivered_without_fetch"] == before["delivered_without_fetch"] + 4
    assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in run(llm, ids, sp(None, max_tokens=4))]

    eng = llm.llm_engine
    vllm_hook.register_vectors(llm, {"fleeting": vec(91)})
    named = sp({"steer": [{"op": "add", "layer": 1, "vector": "fleeting", "scale": 4.0}]}, max_tokens=4)
    eng.add_request("clean-1", {"prompt_token_ids": ids[0]}, sp(steer, max_tokens=4))
    eng.add_request("fleeting-2", {"prompt_token_ids": ids[1]}, named)
    eng.add_request("clean-3", {"prompt_token_ids": ids[2]}, sp(steer, max_tokens=4))
    vllm_hook.delete_vectors(llm, ["fleeting"])
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    before = vllm_hook.stats(llm)["frontend"]
    attach(state_of(eng.input_processor), done, llm.collective_rpc)
    after = vllm_hook.stats(llm)["frontend"]
    got = {o.request_id: vllm_hook.results(o, strict=False) for o in done}
    assert got["clean-1"].ok and got["clean-3"].ok
    assert any("not registered" in e for e in got["fleeting-2"].errors), got["fleeting-2"].errors
    assert (after["fetches"] - before["fetches"], after["delivered_without_fetch"] - before["delivered_without_fetch"]) == (1, 2)
    run(llm, ids[:1], sp(None, max_tokens=1))          # the workers hear of the finishes
    s = vllm_hook.stats(llm)
    assert (s["admitted"], s["active"], s["results_waiting"], s["vectors_in_use"], s["ops_in_use"]) == (0, 0, 0, 0, 0), s


def test_large_captures_are_lent_from_the_workers_arena_and_released(llm):
    """A prompt's rows of 64 KiB and more land in the worker's shared arena (`delivery.arena`).
    A fetch offers the arena to a frontend that has not mapped it (the rows travel as bytes),
    later ones lend the rows: the results view the worker's memory, equal bit for bit to the
    float32 copies of the same rows (the test model's dtype), writable, and their range returns
    to the worker once the results are freed."""
    import gc

    ids = [ids_of(llm, " ".join(PROMPTS * 2))[:200]] * 2
    sites = [{"layers": "all", "tokens": "all", "site": s} for s in ("resid_post", "attn_out")]
    ref = [res(o) for o in run(llm, ids, [sp({"capture": sites}, max_tokens=1)] * 2)]   # copies
    lent = [vllm_hook.stats(llm).get("arena_pieces_lent", 0)]
    for _ in range(3):           # the first fetch after the engine started offers the arena
        outs = run(llm, ids, [sp({"capture": sites, "dtype": "model"}, max_tokens=1)] * 2)
        lent.append(vllm_hook.stats(llm)["arena_pieces_lent"])
        if lent[-1] > lent[-2]:
            break
    assert lent[-1] >= lent[-2] + 2, lent       # one group of points per request
    last = [res(o) for o in outs]
    for a, b in zip(ref, last):
        assert a.ok and b.ok, (a.errors, b.errors)
        for site in ("resid_post", "attn_out"):
            for L in range(4):
                assert b.activations[site][L].shape == (len(ids[0]), 128)
                assert torch.equal(a.activations[site][L], b.activations[site][L]), (site, L)
    last[0].activations["resid_post"][0][0, 0] = 1.0          # the user's to change
    assert vllm_hook.stats(llm)["arena_pieces_out"] > 0
    del last, outs, a, b
    gc.collect()
    assert vllm_hook.stats(llm)["arena_pieces_out"] == 0     # released when the results were freed


def test_decode_rows_are_lent_from_the_arena_part_by_part(llm):
    """Repeated decode steps gather their rows in a run's buffer in the worker's arena
    (`delivery.runs`): a request's all-token rows (its prompt block, the decode step routed on
    its own, the runs) reach the frontend as one reference to the lent parts, the others by
    value, joined and converted there. They equal the same tokens' rows recomputed as a
    prompt (fp32, <= 1e-4), and every lent piece is back once the results are built."""
    ids = [ids_of(llm, PROMPTS[i]) for i in range(2)]
    spec = {"capture": [{"layers": "all", "tokens": "all"}]}
    before = vllm_hook.stats(llm).get("arena_pieces_lent", 0)
    outs = run(llm, ids, [sp(spec, max_tokens=40)] * 2)
    stats = vllm_hook.stats(llm)
    assert stats["arena_pieces_lent"] >= before + 2, (before, stats)      # one a request
    assert stats["arena_pieces_out"] == 0
    for p, o in zip(ids, outs):
        got = res(o)
        gen = list(o.outputs[0].token_ids)
        again = res(run(llm, [p + gen[:-1]], [sp({"capture": [{"layers": "all", "tokens": "prompt"}]},
                                                 max_tokens=1)])[0])
        for L in range(4):
            assert got.positions["resid_post"][L].tolist() == list(range(len(p) + len(gen) - 1))
            assert rel_err(got.activations["resid_post"][L], again.activations["resid_post"][L]) <= 1e-4, L


def _map_arena(llm, ids, spec) -> None:
    """Two batches of `spec`: an engine's first fetch offers the arena, the next names it
    mapped, so the frontend views the rows of the batches after them in place."""
    for _ in range(2):
        run(llm, ids, [sp(spec, max_tokens=1)] * len(ids))


def test_every_token_capture_of_one_token_requests_is_answered_from_their_prefill_step(llm):
    """A request generating one token forwards its prompt only (max_tokens rides the wire as
    "M"): its every-token capture ends with its prefill step, whose reply the worker makes
    then (`worker.prepared`) and the call's fetch takes. Rows equal the same prompts' "prompt"
    capture (fp32, <= 1e-5), beside requests of the same batch that generate more tokens and
    keep theirs to the end."""
    ids = [ids_of(llm, PROMPTS[i % len(PROMPTS)] + " x" * (40 + i)) for i in range(8)]
    spec = {"capture": [{"layers": "all", "tokens": "all"}]}
    _map_arena(llm, ids[:2], spec)
    prepared = vllm_hook.stats(llm)["timing"]["fetches_prepared"]
    outs = run(llm, ids, [sp(spec, max_tokens=1)] * 6 + [sp(spec, max_tokens=4)] * 2)
    assert vllm_hook.stats(llm)["timing"]["fetches_prepared"] > prepared
    for i, o in enumerate(outs):
        got = res(o)
        seq = ids[i] + list(o.outputs[0].token_ids)[:-1]
        ref = res(run(llm, [seq], [sp({"capture": [{"layers": "all", "tokens": "prompt"}]}, max_tokens=1)])[0])
        for L in range(4):
            assert got.positions["resid_post"][L].tolist() == list(range(len(seq))), (i, L)
            assert rel_err(got.activations["resid_post"][L], ref.activations["resid_post"][L]) <= 1e-5, (i, L)


def test_last_token_rows_are_lent_as_one_range_of_their_step(llm):
    """A batch's last-token rows lie back to back in their prefill step's block of the worker's
    arena: a fetch lends them as one reference (a range per step; rows of a step too small for
    the arena by value beside it, `delivery.store._lend_rows`), not packed into its payload.
    The worker makes that reply while the prefill step runs (`worker.prepared`): the call's
    fetch is answered by it. Every request's rows equal the same request run alone (fp32,
    <= 1e-5), and every lent range is back once they are converted."""
    n = 32
    ids = [ids_of(llm, PROMPTS[i % len(PROMPTS)] + " " + str(i)) for i in range(n)]
    sites = ("resid_post", "attn_out", "mlp_out")
    spec = {"capture": [{"layers": "all", "tokens": "last_prompt", "site": s} for s in sites]}
    _map_arena(llm, ids[:2], spec)
    stats = vllm_hook.stats(llm)
    before, prepared = stats["arena_pieces_lent"], stats["timing"]["fetches_prepared"]
    outs = run(llm, ids, [sp(spec, max_tokens=2)] * n)
    after = vllm_hook.stats(llm)
    assert after["arena_pieces_lent"] > before and after["arena_pieces_out"] == 0
    assert after["timing"]["fetches_prepared"] > prepared          # a reply per prefill step
    for i in (0, n // 2, n - 1):
        alone = res(run(llm, [ids[i]], [sp(spec, max_tokens=2)])[0])
        got = res(outs[i])
        for site in sites:
            for L in range(4):
                assert got.positions[site][L].tolist() == [len(ids[i]) - 1]
                assert rel_err(got.activations[site][L], alone.activations[site][L]) <= 1e-5, (i, site, L)
