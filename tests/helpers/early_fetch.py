"""Run by tests/test_modes.py in a process of its own: an offline engine whose core runs in
another process (vLLM's default), where a call's fetch is sent as its last step comes back
(`frontend.delivery.send_early`). Checks, and prints "EARLY-FETCH-OK" at the end:
- a batch whose requests finish at three steps gets the same tokens and rows, bit for bit,
  with the early fetch as without it, all in that one RPC (sent with the last step, for the
  earlier finishers too);
- a call that fails after its early fetch was sent (its progress bar raises) hands back
  what that fetch took: no arena piece still lent, nothing left waiting on the worker, and
  the next call's results are whole.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from vllm import LLM  # noqa: E402

import vllm_hook  # noqa: E402
from tests.conftest import DEFAULTS, FULL_HOOK_CONFIG  # noqa: E402
from tests.helpers.common import PROMPTS, ids_of, run, sp, vec  # noqa: E402
from vllm_hook.adapters import frontend as adapter  # noqa: E402
from vllm_hook.testing.tiny_models import tiny_model  # noqa: E402

STEER = {"steer": [{"op": "add", "layer": 1, "vector": vec(61).tolist(), "scale": 2.0}]}
# (spec, max_tokens): requests finishing at steps 1, 3 and 6
BATCH = [({"capture": [{"layers": [0, 2], "tokens": "all"}]}, 3),
         ({"capture": [{"layers": [1], "tokens": "last_prompt"}]}, 6),
         (STEER, 6),
         (None, 6),
         ({**STEER, "capture": [{"layers": "all", "tokens": "all"}]}, 1),
         ({"capture": [{"layers": [3], "site": "attn_out"}, {"layers": [2], "tokens": "last_prompt"}]}, 6)]


def frontend(llm) -> dict:
    return vllm_hook.stats(llm)["frontend"]


def batch(llm, ids):
    outs = run(llm, ids, [sp(spec, max_tokens=m) for spec, m in BATCH])
    return [(list(o.outputs[0].token_ids), getattr(o, "vllm_hook", None)) for o in outs]


def same(a, b) -> None:
    for (ta, ra), (tb, rb) in zip(a, b):
        assert ta == tb, (ta, tb)
        assert (ra is None) == (rb is None)
        if ra is None:
            continue
        assert ra.ok and rb.ok, (ra.errors, rb.errors)
        assert ra.activations.keys() == rb.activations.keys()
        for site in ra.activations:
            assert ra.activations[site].keys() == rb.activations[site].keys()
            for layer in ra.activations[site]:
                assert torch.equal(ra.activations[site][layer], rb.activations[site][layer]), (site, layer)


class RaisingBar:
    """A progress bar (LLM.generate's use_tqdm) that raises as the call's last output lands
    (the bar over the prompts as they are added passes through)."""

    def __init__(self, iterable=None, total=None, **_):
        self.iterable, self.total, self.n, self.postfix, self.format_dict = iterable, total, 0, "", {"elapsed": 1.0}

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n=1):
        self.n += n
        if self.iterable is None and self.n >= self.total:
            raise RuntimeError("the caller's progress bar failed")

    def refresh(self):
        pass

    def close(self):
        pass


def main() -> None:
    cfg = {**DEFAULTS, "additional_config": {"vllm_hook": FULL_HOOK_CONFIG}}
    llm = LLM(tiny_model("qwen2"), enforce_eager=True, **cfg)
    ids = [ids_of(llm, p) for p in PROMPTS[:len(BATCH)]]
    batch(llm, ids)                            # a first fetch maps the worker's arena

    before = frontend(llm)
    early = batch(llm, ids)
    after = frontend(llm)
    assert after["early_fetches"] - before["early_fetches"] == 1, (before, after)
    assert after["fetches"] - before["fetches"] == 1, (before, after)

    sender = adapter._sender
    adapter._sender = lambda engine_core: None             # the fetch only after the call
    try:
        before = frontend(llm)
        late = batch(llm, ids)
        after = frontend(llm)
    finally:
        adapter._sender = sender
    assert after["early_fetches"] == before["early_fetches"] and after["fetches"] - before["fetches"] == 1
    same(early, late)

    try:
        llm.generate([{"prompt_token_ids": p} for p in ids], [sp(spec, max_tokens=m) for spec, m in BATCH],
                     use_tqdm=RaisingBar)
    except RuntimeError as e:
        assert "progress bar" in str(e)
    else:
        raise AssertionError("the call did not fail")
    st = llm.llm_engine.input_processor.__dict__["_vllm_hook_state"]
    assert st.early is None
    st.pending.clear()                         # the failed call's records (kept until their TTL)
    del early, late
    gc.collect()
    again = batch(llm, ids)
    run(llm, ids[:1], sp(None, max_tokens=1))  # the workers hear of the finishes
    s = vllm_hook.stats(llm)
    assert (s["admitted"], s["active"], s["results_waiting"]) == (0, 0, 0), s
    same(again, batch(llm, ids))
    del again
    gc.collect()
    s = vllm_hook.stats(llm)
    assert s.get("arena_pieces_out", 0) == 0 and "arena_bytes" in s, s
    print("EARLY-FETCH-OK", flush=True)


if __name__ == "__main__":
    main()
