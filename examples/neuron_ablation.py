"""Neuron ablation with an operator hook: zero residual coordinates, measure the effect.

    .venv/bin/python examples/neuron_ablation.py                   # tiny random model, CPU
    .venv/bin/python examples/neuron_ablation.py --model MODEL --layer 12 --dims 42 137

The built-in `zero_dims` hook (called by name: the same spec works against a server) sets the
given coordinates of the residual stream to 0 after a layer; a read-only hook on the last
layer records the next-token distribution at the last prompt token. The example reports the
KL divergence from the unablated run and the top tokens of both, per prompt.
"""

from __future__ import annotations

import argparse

import torch
from vllm import LLM, SamplingParams

import vllm_hook
from vllm_hook import Hook
from vllm_hook.testing.tiny_models import tiny_model

PROMPTS = ["Paris is the capital of", "One two three four five six", "The quick brown fox jumps over the"]


def next_token_logprobs(num_layers: int) -> Hook:
    def fn(ctx, h):
        pos = ctx.positions.tolist()
        if ctx.prompt_len - 1 in pos:
            x = ctx.final_norm(h[pos.index(ctx.prompt_len - 1)][None])
            logits = torch.nn.functional.linear(x, ctx.get_parameter("lm_head.weight"))
            ctx.saved["logprobs"] = logits.float().log_softmax(-1)[0]
    return Hook(fn, [num_layers - 1])


def ablate(llm, prompts: list[list[int]], layer: int, dims: list[int]) -> list[dict]:
    n = llm.llm_engine.model_config.hf_config.num_hidden_layers
    read = next_token_logprobs(n)
    plain = {"hooks": [read]}
    ablated = {"hooks": [{"name": "zero_dims", "args": {"layers": [layer], "dims": dims}}, read]}
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in (0, 1)],
                        [SamplingParams(max_tokens=1, temperature=0.0, extra_args={"vllm_hook": s})
                         for _ in prompts for s in (plain, ablated)], use_tqdm=False)
    res = []
    for a, b in zip(outs[::2], outs[1::2]):
        pa = vllm_hook.results(a).hook_results[0]["logprobs"]
        pb = vllm_hook.results(b).hook_results[1]["logprobs"]
        res.append({"kl": float((pa.exp() * (pa - pb)).sum()), "plain": pa, "ablated": pb})
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--dims", type=int, nargs="+", default=list(range(16)))
    args = ap.parse_args()
    kw = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) if not args.model else {}
    llm = LLM(args.model or tiny_model("qwen2"), additional_config={"vllm_hook": {"hook_layers": "all"}}, **kw)
    tok = llm.get_tokenizer()
    for text, r in zip(PROMPTS, ablate(llm, [tok(p).input_ids for p in PROMPTS], args.layer, args.dims)):
        top = [[tok.decode([int(i)]) for i in r[k].topk(3).indices] for k in ("plain", "ablated")]
        print(f"{text!r}: KL(plain || ablated) = {r['kl']:.4f}; top {top[0]} -> {top[1]}")


if __name__ == "__main__":
    main()
