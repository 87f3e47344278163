"""Logit lens with a Python hook: what each layer's residual stream would predict.

    .venv/bin/python examples/logit_lens.py                        # tiny random model, CPU
    .venv/bin/python examples/logit_lens.py --model Qwen/Qwen2-1.5B-Instruct --png lens.png

A batched hook at every layer applies the model's final norm (`ctx.final_norm`) and the
unembedding (`ctx.get_parameter("lm_head.weight")`) to the stream, and saves each row's top-k
tokens and probabilities: one matrix product per layer and step for the whole batch. The PNG
shows the top-1 probability per layer and prompt position, labelled with the token. With the
tiny model's random weights the predictions are noise; on a trained model the last layers
converge on the model's answer.
"""

from __future__ import annotations

import argparse

import torch
from vllm import LLM, SamplingParams

import vllm_hook
from vllm_hook.testing.tiny_models import tiny_model


def lens_hook(layers: list[int], k: int = 3) -> vllm_hook.Hook:
    def fn(ctx, h):
        logits = torch.nn.functional.linear(ctx.final_norm(h), ctx.get_parameter("lm_head.weight"))
        top = logits.float().softmax(-1).topk(k, dim=-1)
        ctx.save(f"ids{ctx.layer_idx}", top.indices)
        ctx.save(f"p{ctx.layer_idx}", top.values)
    return vllm_hook.Hook(fn, layers, batched=True)


def run(llm, prompts: list[str], k: int = 3, max_tokens: int = 4):
    """Per prompt: {"ids": [layers, rows, k], "p": [layers, rows, k]} and the output."""
    n = llm.llm_engine.model_config.hf_config.num_hidden_layers
    tok = llm.get_tokenizer()
    hook = lens_hook(list(range(n)), k)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                            extra_args={"vllm_hook": {"hooks": [hook]}})
    outs = llm.generate([{"prompt_token_ids": tok(p).input_ids} for p in prompts], params, use_tqdm=False)
    lens = []
    for o in outs:
        saved = vllm_hook.results(o).hook_results[0]
        lens.append({"ids": torch.stack([torch.cat(saved[f"ids{L}"]) for L in range(n)]),
                     "p": torch.stack([torch.cat(saved[f"p{L}"]) for L in range(n)])})
    return lens, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path or name (default: the tiny qwen2 fixture)")
    ap.add_argument("--prompt", default="Paris is the capital of France. Berlin is the capital of")
    ap.add_argument("--png", help="write the heatmap here")
    args = ap.parse_args()
    kw = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) if not args.model else {}
    llm = LLM(args.model or tiny_model("qwen2"), additional_config={"vllm_hook": {"hook_layers": "all"}}, **kw)
    (lens,), (out,) = run(llm, [args.prompt])
    tok = llm.get_tokenizer()
    P = len(out.prompt_token_ids)
    words = [tok.decode([i]) for i in out.prompt_token_ids]
    for L in range(lens["ids"].shape[0]):
        top = [tok.decode([int(i)]) for i in lens["ids"][L, P - 1]]
        print(f"layer {L:2d}: next after {words[-1]!r}: {top}  p={lens['p'][L, P - 1].tolist()}")
    if args.png:
        from vllm_hook.analyzers import plots

        text = [[tok.decode([int(i)])[:4] for i in lens["ids"][L, :P, 0]] for L in range(lens["ids"].shape[0])]
        print("wrote", plots.plot_layers_by_tokens(lens["p"][:, :P, 0], args.png, words, "logit lens: top-1",
                                                   "probability", cell_text=text))


if __name__ == "__main__":
    main()
