"""Everything a client can grow has a limit and a clear error (real engine, small limits):
capture bytes per request (refused at admission), capture bytes in flight on a worker (the
request that passes it loses its captures, with an error; the others keep theirs), named
vectors."""

from __future__ import annotations

import gc

import pytest
import torch

import vllm_hook
from tests.helpers.common import PROMPTS, ids_of, rel_err, run, sp, vec

pytestmark = pytest.mark.engine
ROW = 128 * 4                  # one captured row of the tiny model (hidden 128, float32)
LIMITS = {"max_capture_bytes_per_request": 300_000, "max_inflight_capture_bytes": 250_000,
          "max_named_vectors": 3}
ALL = {"capture": [{"layers": "all", "tokens": "all"}]}


@pytest.fixture
def llm(engines):
    return engines.get("qwen2-limits", arch="qwen2", enforce_eager=True,
                       additional_config={"vllm_hook": LIMITS})


def test_capture_bytes_per_request_are_checked_at_admission(llm):
    ids = ids_of(llm, PROMPTS[0])
    # 4 layers x (prompt + 200 generated) rows x 512 bytes > 300,000: refused, nothing runs.
    with pytest.raises(vllm_hook.SpecError, match="max_capture_bytes_per_request") as e:
        run(llm, [ids], [sp(ALL, max_tokens=200)])
    assert e.value.where.endswith("capture") and "lower max_tokens" in e.value.fix
    assert f"{4 * (len(ids) + 200) * ROW:,} bytes" in str(e.value)
    # The same spec with fewer tokens, or only the last prompt token, fits.
    assert vllm_hook.results(run(llm, [ids], [sp(ALL, max_tokens=10)])[0]).ok
    last = {"capture": [{"layers": "all", "tokens": "last_prompt"}]}
    assert vllm_hook.results(run(llm, [ids], [sp(last, max_tokens=400)])[0]).ok


def test_capture_bytes_in_flight_cost_only_the_request_that_passes_them(llm):
    ids = ids_of(llm, " ".join(PROMPTS * 4))
    prompts = [ids[i:i + 40] for i in range(0, 240, 40)]
    solo = [run(llm, [p], [sp(ALL, max_tokens=10, ignore_eos=True)])[0] for p in prompts]
    assert all(vllm_hook.results(o).ok for o in solo)       # ~100 KB each: fits alone
    outs = run(llm, prompts, [sp(ALL, max_tokens=10, ignore_eos=True)] * len(prompts))
    got = [vllm_hook.results(o, strict=False) for o in outs]
    dropped = [r for r in got if any("captures dropped" in e for e in r.errors)]
    kept = [(r, s) for r, s in zip(got, solo) if r.ok]
    # 6 x ~100 KB against 250,000 bytes in flight: some lose their captures, some keep them.
    assert dropped and kept and len(dropped) + len(kept) == len(prompts)
    assert "max_inflight_capture_bytes" in dropped[0].errors[0]
    for r, s in kept:
        ref = vllm_hook.results(s)
        for L, t in ref.activations["resid_post"].items():
            assert torch.equal(r.positions["resid_post"][L], ref.positions["resid_post"][L])
            assert rel_err(r.activations["resid_post"][L], t) <= 1e-5
    for o, s in zip(outs, solo):             # tokens are never affected
        assert list(o.outputs[0].token_ids) == list(s.outputs[0].token_ids)
    del outs, got, dropped, kept, solo
    gc.collect()
    st = vllm_hook.stats(llm)
    assert st["capture_bytes_in_flight"] == 0 and st["max_inflight_capture_bytes"] == 250_000
    assert st["timing"]["captures_dropped"] >= 1


def test_named_vectors_are_bounded(llm):
    vllm_hook.delete_vectors(llm, ["a", "b", "c", "d"])
    assert vllm_hook.register_vectors(llm, {"a": vec(1), "b": vec(2), "c": vec(3)}) == ["a", "b", "c"]
    with pytest.raises(vllm_hook.SpecError, match="4 named vectors, more than max_named_vectors") as e:
        vllm_hook.register_vectors(llm, {"d": vec(4)})
    assert "delete_vectors" in e.value.fix
    assert vllm_hook.register_vectors(llm, {"c": vec(5)}) == ["a", "b", "c"]     # replacing: fine
    vllm_hook.delete_vectors(llm, ["a"])
    assert vllm_hook.register_vectors(llm, {"d": vec(4)}) == ["b", "c", "d"]
    vllm_hook.delete_vectors(llm, ["b", "c", "d"])
