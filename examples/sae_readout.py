"""A sparse-autoencoder-style encoder read out per token with a batched Python hook.

    .venv/bin/python examples/sae_readout.py                       # tiny model, random SAE
    .venv/bin/python examples/sae_readout.py --model MODEL --layer 12 --sae my_sae.safetensors

The hook computes f = ReLU((h - b_dec) W_enc + b_enc) for every row of every request in the
batch at one layer (one matrix product per step, whatever the batch) and saves each row's
top-k features. `--sae` loads W_enc [hidden, features], b_enc, b_dec from a safetensors file;
without it the encoder is random, so the features mean nothing (the mechanics are the point).
"""

from __future__ import annotations

import argparse

import torch
from vllm import LLM, SamplingParams

import vllm_hook
from vllm_hook import Hook
from vllm_hook.testing.tiny_models import tiny_model


def random_sae(hidden: int, features: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"W_enc": torch.randn(hidden, features, generator=g) / hidden ** 0.5,
            "b_enc": -0.1 * torch.ones(features), "b_dec": torch.zeros(hidden)}


def sae_hook(layer: int, sae: dict[str, torch.Tensor], k: int = 5) -> Hook:
    cache: dict = {}

    def fn(ctx, h):
        if h.device not in cache:          # the encoder on the model's device, once
            cache[h.device] = {n: t.to(h.device, torch.float32) for n, t in sae.items()}
        w = cache[h.device]
        f = torch.relu((h.float() - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
        top = f.topk(k, dim=-1)
        ctx.save("features", top.indices)
        ctx.save("activations", top.values)
    return Hook(fn, [layer], batched=True)


def readout(llm, prompts: list[list[int]], layer: int, sae: dict, k: int = 5) -> list[dict]:
    hook = sae_hook(layer, sae, k)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=3, temperature=0.0, extra_args={"vllm_hook": {
                            "hooks": [hook], "capture": [{"layers": [layer]}]}}), use_tqdm=False)
    res = []
    for o in outs:
        r = vllm_hook.results(o)
        saved = r.hook_results[0]
        res.append({"features": torch.cat(saved["features"]), "activations": torch.cat(saved["activations"]),
                    "stream": r.activations["resid_post"][layer], "output": o})
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--sae", help="safetensors with W_enc, b_enc, b_dec (default: random)")
    ap.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.")
    args = ap.parse_args()
    kw = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) if not args.model else {}
    llm = LLM(args.model or tiny_model("qwen2"), additional_config={"vllm_hook": {"hook_layers": [args.layer]}}, **kw)
    hidden = llm.llm_engine.model_config.get_hidden_size()
    if args.sae:
        from safetensors.torch import load_file

        sae = load_file(args.sae)
    else:
        sae = random_sae(hidden, 4 * hidden)
    tok = llm.get_tokenizer()
    (r,) = readout(llm, [tok(args.prompt).input_ids], args.layer, sae)
    ids = list(r["output"].prompt_token_ids) + list(r["output"].outputs[0].token_ids)
    for i, (f, a) in enumerate(zip(r["features"].tolist(), r["activations"].tolist())):
        print(f"{tok.decode([ids[i]])!r:>12}: " + ", ".join(f"#{x}={v:.2f}" for x, v in zip(f, a)))


if __name__ == "__main__":
    main()
