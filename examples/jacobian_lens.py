"""Jacobian lens: fit each layer's average Jacobian offline, read the stream through it in vLLM.

    .venv/bin/python examples/jacobian_lens.py                       # tiny random model, CPU
    .venv/bin/python examples/jacobian_lens.py --baseline            # the plain logit lens
    .venv/bin/python examples/jacobian_lens.py --model Qwen/Qwen2-1.5B-Instruct --fit-prompts 4

`vllm_hook.analyzers.jacobian_lens.fit` averages, over the tokens of a few prompts, the
Jacobian of the last decoder layer's output with respect to each layer's output (Hugging Face,
fp32, CPU: seconds for the tiny model; on a real model fit on a GPU or on few prompts, and
keep the file: `--save` / `--load`). The engine then reads every layer through it with one
batched hook (`readout_hook`) and prints the top tokens at the last prompt position. With the
tiny model's random weights the readout is noise; on a trained model the transported early
layers predict the answer sooner than the plain logit lens does.
"""

from __future__ import annotations

import argparse

import torch
from safetensors.torch import load_file, save_file
from vllm import LLM, SamplingParams

import vllm_hook
from vllm_hook.analyzers import jacobian_lens
from vllm_hook.testing.tiny_models import tiny_model

FIT_PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
               "One two three four five six seven eight nine ten.", "You are a helpful assistant."]


def fit_on(path: str, tok, prompts: list[str], layers: list[int], positions: int | None) -> dict[int, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return jacobian_lens.fit(hf, [tok(p).input_ids for p in prompts], layers, positions_per_prompt=positions)


def read(llm, prompts: list[list[int]], jacobians: dict[int, torch.Tensor], k: int = 5,
         baseline: bool = False, max_tokens: int = 1) -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Per prompt: {layer: (ids [rows, k], logprobs [rows, k])}, rows in token order."""
    hook = jacobian_lens.readout_hook(jacobians, k=k, baseline=baseline)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={"vllm_hook": {"hooks": [hook]}})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = []
    for o in outs:
        saved = vllm_hook.results(o).hook_results[0]
        got.append({L: (torch.cat(saved[f"layer{L}.ids"]), torch.cat(saved[f"layer{L}.logprobs"]))
                    for L in jacobians})
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path or name (default: the tiny qwen2 fixture)")
    ap.add_argument("--prompt", default="Paris is the capital of France. Berlin is the capital of")
    ap.add_argument("--fit-prompts", type=int, default=2, help="how many built-in prompts to fit on")
    ap.add_argument("--positions", type=int, default=4, help="tokens per prompt to average over (the last ones)")
    ap.add_argument("--baseline", action="store_true", help="read out without the Jacobians (logit lens)")
    ap.add_argument("--save", help="write the fitted Jacobians here (safetensors)")
    ap.add_argument("--load", help="read fitted Jacobians from here instead of fitting")
    args = ap.parse_args()
    path = args.model or tiny_model("qwen2")
    kw = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) if not args.model else {}
    llm = LLM(path, additional_config={"vllm_hook": {"hook_layers": "all"}}, **kw)
    tok = llm.get_tokenizer()
    n = llm.llm_engine.model_config.hf_config.num_hidden_layers
    if args.load:
        jac = {int(k): v for k, v in load_file(args.load).items()}
    else:
        jac = fit_on(path, tok, FIT_PROMPTS[:args.fit_prompts], list(range(n)), args.positions)
    if args.save:
        save_file({str(k): v.contiguous() for k, v in jac.items()}, args.save)
    ids = tok(args.prompt).input_ids
    (got,) = read(llm, [ids], jac, baseline=args.baseline)
    label = "logit lens" if args.baseline else "Jacobian lens"
    for L in sorted(got):
        top = [tok.decode([int(i)]) for i in got[L][0][len(ids) - 1]]
        print(f"{label}, layer {L:2d}: next {top}  logprob {got[L][1][len(ids) - 1, 0].item():.3f}")


if __name__ == "__main__":
    main()
