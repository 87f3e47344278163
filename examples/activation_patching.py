"""Activation patching between two prompts with Python hooks.

    .venv/bin/python examples/activation_patching.py               # tiny random model, CPU
    .venv/bin/python examples/activation_patching.py --model MODEL --png patch.png

Run a source prompt ("... Paris ...") and a target prompt that differs in one token
("... Berlin ..."); record the source's residual stream at every layer; then run the target
once per (layer, position), with that one state replaced by the source's (a post hook), and
read how far the answer's probability moves toward the source's answer. All runs share one
batch. Random weights on the tiny model: the numbers are exact, their meaning is nil.
"""

from __future__ import annotations

import argparse

import torch
from vllm import LLM, SamplingParams

import vllm_hook
from causal_tracing import answer_prob_hook, restore_hook
from vllm_hook.testing.tiny_models import tiny_model


def patch(llm, source: list[int], target: list[int], answer: int) -> dict:
    """{"source": p, "target": p, "patched": [layers, tokens]}: the answer's probability."""
    assert len(source) == len(target), "patching position by position needs prompts of one length"
    n = llm.llm_engine.model_config.hf_config.num_hidden_layers
    read = answer_prob_hook(n, answer)

    def sp(hooks, capture=None):
        spec = {"hooks": hooks + [read], **({"capture": capture} if capture else {})}
        return SamplingParams(max_tokens=1, temperature=0.0, extra_args={"vllm_hook": spec})

    src, tgt = llm.generate([{"prompt_token_ids": source}, {"prompt_token_ids": target}],
                            [sp([], [{"layers": "all", "tokens": "prompt"}]), sp([])], use_tqdm=False)
    states = vllm_hook.results(src).activations["resid_post"]
    runs = [(L, t) for L in range(n) for t in range(len(target))]
    outs = llm.generate([{"prompt_token_ids": target}] * len(runs),
                        [sp([restore_hook(L, t, states[L][t])]) for L, t in runs], use_tqdm=False)
    patched = torch.zeros(n, len(target))
    for (L, t), o in zip(runs, outs):
        patched[L, t] = vllm_hook.results(o).hook_results[-1]["p"]
    p = [float(vllm_hook.results(o).hook_results[-1]["p"]) for o in (src, tgt)]
    return {"source": p[0], "target": p[1], "patched": patched}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--source", default="Paris is the capital of")
    ap.add_argument("--target", default="Berlin is the capital of")
    ap.add_argument("--png")
    args = ap.parse_args()
    kw = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) if not args.model else {}
    llm = LLM(args.model or tiny_model("qwen2"), additional_config={"vllm_hook": {"hook_layers": "all"}}, **kw)
    tok = llm.get_tokenizer()
    s, t = tok(args.source).input_ids, tok(args.target).input_ids
    answer = llm.generate([{"prompt_token_ids": s}], SamplingParams(max_tokens=1, temperature=0.0),
                          use_tqdm=False)[0].outputs[0].token_ids[0]
    res = patch(llm, s, t, answer)
    print(f"answer {tok.decode([answer])!r}: source p={res['source']:.4f}, target p={res['target']:.4f}")
    if args.png:
        from vllm_hook.analyzers import plots

        print("wrote", plots.plot_layers_by_tokens(res["patched"] - res["target"], args.png,
                                                   [tok.decode([i]) for i in t], "patched - target", "p"))


if __name__ == "__main__":
    main()
