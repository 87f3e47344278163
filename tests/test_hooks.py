"""Python hooks on real engines (CPU: an engine with hook layers runs eagerly, see
docs/hooks.md): what a hook sees and changes equals HF transformers fp32 running the same
Python hook; hooked, steered, captured and plain requests stay isolated in one batch; a
hook that fails costs only its request; persistent hooks register, collect and clear."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import vllm_hook
from tests.helpers import hf_ref
from tests.helpers.common import PROMPTS, ids_of, rel_err, res, run, sp, vec
from vllm_hook import Hook
from vllm_hook.testing.tiny_models import tiny_model

pytestmark = pytest.mark.engine
TOL = 1e-4
H = 128
HOOKS_CONFIG = {"hook_layers": "all", "max_hook_state_bytes": 4 << 20}


def hooks_engine(engines, arch="qwen2", **kw):
    return engines.get(f"{arch}-hooks", arch=arch, additional_config={"vllm_hook": HOOKS_CONFIG}, **kw)


@pytest.fixture
def llm(engines):
    return hooks_engine(engines)


def _save_rows(ctx, h):
    """A read-only hook: every row it is given, and the facts of each call."""
    key = f"{'pre' if ctx.pre else 'post'}{ctx.layer_idx}"
    ctx.saved.setdefault(key, []).append(h.clone())
    ctx.saved.setdefault(key + ".pos", []).append(ctx.positions)
    assert ctx.seq_len == h.shape[0] == len(ctx.positions)
    assert ctx.is_prompt.tolist() == [p < ctx.prompt_len for p in ctx.positions.tolist()]
    ctx.saved["request_id"], ctx.saved["prompt_len"] = ctx.request_id, ctx.prompt_len
    return None


def _rows(saved: dict, key: str) -> tuple[torch.Tensor, list[int]]:
    return torch.cat(saved[key]), torch.cat(saved[key + ".pos"]).tolist()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mixtral"])
def test_hook_sees_the_hf_stream_post_and_pre(engines, arch):
    llm = hooks_engine(engines, arch)
    hf = hf_ref.load(tiny_model(arch))
    ids = ids_of(llm, PROMPTS[0])
    hooks = [Hook(_save_rows, [0, 1, 2, 3]), Hook(_save_rows, [0, 1, 2, 3], pre=True)]
    out = run(llm, [ids], [sp({"hooks": hooks}, max_tokens=6)])[0]
    r = res(out)
    seq = ids + list(out.outputs[0].token_ids)[:-1]
    ref, _ = hf_ref.activations(hf, seq)
    assert len(r.hook_results) == 2 and r.hook_results[0]["prompt_len"] == len(ids)
    for L in range(4):
        for i, (kind, site) in enumerate((("post", "resid_post"), ("pre", "resid_pre"))):
            got, pos = _rows(r.hook_results[i], f"{kind}{L}")
            assert pos == list(range(len(seq))), (arch, kind, L)       # every row, once
            assert got.dtype == torch.float32
            err = rel_err(got, ref[site][L])
            assert err <= TOL, f"{arch} {kind} layer {L}: rel err {err:.2e}"


def _modify(ctx, h):
    """Position-wise, so the same on HF's whole-sequence recompute as on vLLM's rows."""
    g = torch.Generator().manual_seed(ctx.layer_idx)
    v = torch.randn(h.shape[-1], generator=g).to(h.device, h.dtype)
    return h * 1.25 + 2.0 * v


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mixtral"])
def test_modifying_hook_matches_the_same_hook_on_hf(engines, arch):
    llm = hooks_engine(engines, arch, logprobs_mode="raw_logits")
    hf = hf_ref.load(tiny_model(arch))
    ids = ids_of(llm, PROMPTS[2])
    hooks = [Hook(_modify, [1]), Hook(_modify, [3], pre=True)]
    out = run(llm, [ids], [sp({"hooks": hooks}, max_tokens=16, logprobs=20)])[0]
    plain = run(llm, [ids], [sp(None, max_tokens=16)])[0]
    ref_tokens, ref_logits = hf_ref.hooked_greedy(hf, ids, 16, hooks)
    got = list(out.outputs[0].token_ids)
    assert got == ref_tokens, f"{arch}: {got} != HF {ref_tokens}"
    assert got != list(plain.outputs[0].token_ids), "the hook changed nothing: was it applied?"
    last = out.outputs[0].logprobs[-1]
    toks = torch.tensor(list(last))
    vals = torch.tensor([last[t].logprob for t in toks.tolist()])
    assert rel_err(vals, ref_logits[toks]) <= TOL


def test_zeroing_hook_leaves_exact_zeros_downstream(llm):
    ids = ids_of(llm, PROMPTS[1])
    hooks = [Hook(lambda ctx, h: torch.zeros_like(h), [1]), Hook(_save_rows, [2], pre=True)]
    spec = {"hooks": hooks, "capture": [{"layers": [2], "site": "resid_pre"}, {"layers": [2]}]}
    r = res(run(llm, [ids], [sp(spec, max_tokens=5)])[0])
    assert torch.count_nonzero(r.activations["resid_pre"][2]) == 0     # what layer 2 reads
    assert torch.count_nonzero(_rows(r.hook_results[1], "pre2")[0]) == 0


def test_get_parameter_is_the_checkpoint_tensor(llm):
    want = load_file(f"{tiny_model('qwen2')}/model.safetensors")

    def fetch(ctx, h):
        if "lm_head" not in ctx.saved:
            ctx.saved["lm_head"] = ctx.get_parameter("lm_head.weight").clone()
            ctx.saved["norm"] = ctx.get_parameter("model.norm.weight").clone()
            ctx.saved["lens"] = ctx.final_norm(h[-1:]).clone()

    ids = ids_of(llm, PROMPTS[3])
    out = run(llm, [ids], [sp({"hooks": [Hook(fetch, [3])], "capture": [{"layers": [3]}]}, max_tokens=2)])[0]
    r = res(out)
    saved = r.hook_results[0]
    assert torch.equal(saved["lm_head"], want["lm_head.weight"])
    assert torch.equal(saved["norm"], want["model.norm.weight"])
    hf = hf_ref.load(tiny_model("qwen2"))
    x = r.activations["resid_post"][3][len(ids) - 1:len(ids)]
    assert rel_err(saved["lens"], hf.model.norm(x)) <= TOL
    assert vllm_hook.prefetch_params(llm, ["lm_head.weight"]) == ["lm_head.weight", "model.norm.weight"]
    with pytest.raises(RuntimeError, match="no parameter 'nope.weight'"):
        vllm_hook.prefetch_params(llm, ["nope.weight"])


def _mixed():
    v = vec(51).tolist()
    return [
        ({"hooks": [Hook(_modify, [2])], "capture": [{"layers": [3]}]}, 9),
        ({"steer": [{"op": "add", "layer": 1, "vector": v, "scale": 4.0}]}, 7),
        ({"capture": [{"layers": "all", "tokens": "all"}]}, 8),
        (None, 6),
        ({"hooks": [Hook(_save_rows, [1, 3]), Hook(_modify, [0], pre=True)],
          "steer": [{"op": "add", "layer": 2, "vector": v, "scale": 2.0}],
          "capture": [{"layers": [2], "tokens": "generated"}]}, 10),
        ({"hooks": [Hook(_save_rows, [0])]}, 5),
    ]


def _same_results(a, b, what):
    ra, rb = vllm_hook.results(a), vllm_hook.results(b)
    for site in rb.activations:
        for L in rb.activations[site]:
            assert torch.equal(ra.activations[site][L], rb.activations[site][L]), (what, site, L)
    assert len(ra.hook_results) == len(rb.hook_results)
    for x, y in zip(ra.hook_results, rb.hook_results):
        assert x.keys() == y.keys(), what
        for k in x:
            if isinstance(x[k], list) and x[k] and isinstance(x[k][0], torch.Tensor):
                assert all(torch.equal(p, q) for p, q in zip(x[k], y[k])), (what, k)


def test_mixed_batch_each_equal_to_its_solo_run(llm):
    specs = _mixed()
    prompts = [ids_of(llm, PROMPTS[i]) for i in range(len(specs))]
    params = [sp(s, max_tokens=n, ignore_eos=True) for s, n in specs]
    together = run(llm, prompts, params)
    for i, (p, prm) in enumerate(zip(prompts, params)):
        alone = run(llm, [p], [prm])[0]
        assert list(together[i].outputs[0].token_ids) == list(alone.outputs[0].token_ids), i
        if specs[i][0] is None:
            assert not hasattr(together[i], "vllm_hook")
            continue
        _same_results(together[i], alone, i)
    # A hook sees its own request's rows only: the read-only hook of request 5 got exactly
    # its own prompt and generated rows, equal to its own stream.
    saved = res(together[5]).hook_results[0]
    rows, pos = _rows(saved, "post0")
    assert pos == list(range(len(prompts[5]) + 4)) and saved["request_id"] == saved["request_id"]


def test_hook_errors_cost_only_their_request(llm):
    ids = ids_of(llm, PROMPTS[4])

    def boom(ctx, h):
        if ctx.positions[-1] >= ctx.prompt_len + 1:
            raise ValueError("deliberate")

    cases = [({"hooks": [Hook(boom, [1])]}, "raised ValueError: deliberate (layer 1)"),
             ({"hooks": [Hook(lambda c, h: h[:1], [2])]}, "expected a tensor of shape"),
             ({"hooks": [Hook(lambda c, h: h, [2], read_only=True)]}, "but it is read_only: it must return None"),
             ({"hooks": [Hook(lambda c, h: h * float("nan"), [2])], "capture": [{"layers": [2]}]}, None)]
    good = {"capture": [{"layers": [1, 2]}], "hooks": [Hook(_save_rows, [2])]}
    for spec, words in cases:
        solo = run(llm, [ids], [sp(good, max_tokens=6, ignore_eos=True)])[0]
        bad, ok = run(llm, [ids, ids], [sp(spec, max_tokens=6, ignore_eos=True),
                                        sp(good, max_tokens=6, ignore_eos=True)])
        _same_results(ok, solo, words)
        r = vllm_hook.results(bad, strict=False)
        if words is None:       # a NaN result is sanitised: the stream stays finite
            assert r.ok and torch.isfinite(r.activations["resid_post"][2]).all()
            assert torch.count_nonzero(r.activations["resid_post"][2]) == 0
            continue
        assert not r.ok and any(words in e and "runs no more" in e for e in r.errors), r.errors
        assert len(bad.outputs[0].token_ids) == 6


def test_hook_state_is_bounded(llm):
    def hoard(ctx, h):
        ctx.saved.setdefault("x", []).append(torch.zeros(16384, dtype=torch.float32))

    out = run(llm, [ids_of(llm, PROMPTS[5])], [sp({"hooks": [Hook(hoard, [0, 1, 2, 3])]}, max_tokens=24)])[0]
    r = vllm_hook.results(out, strict=False)
    assert any("max_hook_state_bytes" in e for e in r.errors), r.errors
    assert r.hook_results == [{}]


def test_spec_errors_name_hook_layers(engines, llm):
    ids = ids_of(llm, PROMPTS[0])
    with pytest.raises(vllm_hook.SpecError, match="no operator hook named 'nope'"):
        run(llm, [ids], [sp({"hooks": [{"name": "nope"}]})])
    with pytest.raises(vllm_hook.SpecError, match="argument layers"):
        run(llm, [ids], [sp({"hooks": [{"name": "logit_lens", "args": {"layers": "x"}}]})])
    plain = engines.get("qwen2-compiled", arch="qwen2")
    with pytest.raises(vllm_hook.SpecError) as e:
        run(plain, [ids], [sp({"hooks": [Hook(_save_rows, [1])]})])
    assert "vllm_hook.hook_layers including 1" in str(e.value) and e.value.where.endswith("layer_indices")


def test_operator_hooks_by_name_offline(llm):
    ids = ids_of(llm, PROMPTS[6])
    spec = {"hooks": [{"name": "logit_lens", "args": {"layers": [1, 3], "k": 4}},
                      {"name": "stream_norms", "args": {"layers": [2]}}],
            "capture": [{"layers": [1, 2, 3]}]}
    out = run(llm, [ids], [sp(spec, max_tokens=3)])[0]
    r = res(out)
    lens, norms = r.hook_results
    hf = hf_ref.load(tiny_model("qwen2"))
    for L in (1, 3):
        ids_l = torch.cat(lens[f"layer{L}.ids"])
        assert ids_l.shape == (len(ids) + 2, 4)
        logits = hf.lm_head(hf.model.norm(r.activations["resid_post"][L]))
        assert torch.equal(ids_l[:, 0], logits.argmax(-1))
    assert torch.allclose(torch.cat(norms["layer2"]), r.activations["resid_post"][2].norm(dim=-1), rtol=1e-5)


def test_persistent_hooks(llm):
    ids = ids_of(llm, PROMPTS[7])

    def last_norm(ctx, h):
        ctx.saved.setdefault("norms", []).append(float(h[-1].norm()))

    assert vllm_hook.register_hooks(llm, [Hook(last_norm, [2])]) == 1
    vllm_hook.clear_hook_results(llm)
    outs = run(llm, [ids] * 12 + [ids[:5]] * 8,
               [sp(None, max_tokens=3)] * 12 + [sp({"capture": [{"layers": [2]}]}, max_tokens=3)] * 8)
    got = vllm_hook.collect_hook_results(llm)
    mine = {o.request_id for o in outs}
    assert mine <= set(got), (sorted(mine - set(got)), sorted(got)[:5])
    for o in outs:
        entry = got[o.request_id]
        assert len(entry) == 1 and len(entry[0]["norms"]) == 3       # prefill + 2 decode steps
    assert len(vllm_hook.collect_hook_results(llm)) == len(got)       # non-destructive
    # A persistent hook's request reads no cached prefix and shares none.
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert vllm_hook.clear_hook_results(llm) >= 20
    assert vllm_hook.collect_hook_results(llm) == {}
    vllm_hook.clear_hooks(llm)
    after = run(llm, [ids, ids[:3]], [sp(None, max_tokens=2)] * 2)
    assert not {o.request_id for o in after} & set(vllm_hook.collect_hook_results(llm))
    assert vllm_hook.stats(llm)["persistent_hooks"] == 0


LONG = " ".join(PROMPTS[:6])          # ~70 tokens: several 16-token chunks


@pytest.fixture
def chunked(engines):
    return engines.get("qwen2-chunked-hooks", arch="qwen2", max_num_batched_tokens=16, max_num_seqs=8,
                       enable_prefix_caching=True, block_size=32,
                       additional_config={"vllm_hook": HOOKS_CONFIG})


def test_hooks_under_chunked_prefill_and_prefix_caching(chunked):
    llm = chunked
    hf = hf_ref.load(tiny_model("qwen2"))
    ids = ids_of(llm, LONG)
    first = run(llm, [ids], [sp(None, max_tokens=4)])[0]                # warms the prefix cache
    assert run(llm, [ids], [sp(None, max_tokens=4)])[0].num_cached_tokens > 0
    out = run(llm, [ids], [sp({"hooks": [Hook(_save_rows, [1]), Hook(_modify, [2])]}, max_tokens=4)])[0]
    # It read no cached prefix (its hooks see every row) ...
    assert out.num_cached_tokens == 0
    saved = res(out).hook_results[0]
    rows, pos = _rows(saved, "post1")
    assert len(saved["post1"]) >= 5 + 3          # the prompt in 16-token chunks, then decodes
    seq = ids + list(out.outputs[0].token_ids)[:-1]
    ref, _ = hf_ref.activations(hf, seq)
    assert pos == list(range(len(seq))) and rel_err(rows, ref["resid_post"][1]) <= TOL
    ref_tokens, _ = hf_ref.hooked_greedy(hf, ids, 4, [Hook(_modify, [2])])
    assert list(out.outputs[0].token_ids) == ref_tokens
    # ... and left no KV that others reuse: a plain request after it equals the first.
    again = run(llm, [ids], [sp(None, max_tokens=4)])[0]
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)


@pytest.fixture
def small_kv(engines):
    # KV for ~512 tokens: six 100-token requests cannot all fit, so vLLM preempts.
    return engines.get("qwen2-preempt-hooks", arch="qwen2", max_num_seqs=8, kv_cache_memory_bytes=2048 * 512,
                       max_model_len=256, block_size=32, additional_config={"vllm_hook": HOOKS_CONFIG})


def _newest_by_position(saved: dict, key: str) -> dict[int, torch.Tensor]:
    """A preempted request's hooks see its recomputed rows again: the newest of each."""
    rows, pos = _rows(saved, key)
    return {p: rows[i] for i, p in enumerate(pos)}


def test_hooks_under_preemption_and_abort(small_kv):
    from tests.conftest import preempted_then_alone

    llm = small_kv
    specs = [{"hooks": [Hook(_save_rows, [1])]}, {"hooks": [Hook(_modify, [2])]}, None,
             {"hooks": [Hook(_save_rows, [3]), Hook(_modify, [0], pre=True)]},
             {"steer": [{"op": "add", "layer": 1, "vector": vec(33).tolist(), "scale": 5.0}]},
             {"hooks": [Hook(_modify, [1])], "capture": [{"layers": [2]}]}]
    prompts = [ids_of(llm, PROMPTS[i]) for i in range(len(specs))]
    params = [sp(s, max_tokens=90, ignore_eos=True) for s in specs]
    for spec, (together, alone) in zip(specs, preempted_then_alone(llm, prompts, params)):
        if spec and "hooks" in spec:
            a, b = res(together), res(alone)
            for x, y in zip(a.hook_results, b.hook_results):
                for key in [k for k in y if k.startswith("post") and not k.endswith(".pos")]:
                    na, nb = _newest_by_position(x, key), _newest_by_position(y, key)
                    assert na.keys() == nb.keys() and all(torch.allclose(na[k], nb[k], atol=1e-5) for k in nb)
    # Abort: nothing of an aborted hooked request stays on the workers.
    eng = llm.llm_engine
    ids = prompts[0]
    for n in range(3):
        eng.add_request(f"hook-abort-{n}", {"prompt_token_ids": ids},
                        sp({"hooks": [Hook(_save_rows, [1])]}, max_tokens=40))
    for _ in range(4):
        eng.step()
    eng.abort_request(["hook-abort-0", "hook-abort-1", "hook-abort-2"])
    while eng.has_unfinished_requests():
        eng.step()
    run(llm, [ids], [sp(None, max_tokens=2)])
    s = vllm_hook.stats(llm)
    assert (s["admitted"], s["active"], s["hooked"], s["results_waiting"]) == (0, 0, 0, 0), s
