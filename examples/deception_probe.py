"""A deception probe in the style of Apollo Research's linear probes: contrastive pairs,
activations from a persistent hook, a logistic-regression probe.

    .venv/bin/python examples/deception_probe.py                     # tiny random model, CPU
    .venv/bin/python examples/deception_probe.py --model Qwen/Qwen2-1.5B-Instruct --layer 14

The method, in our words: each training statement is put behind two instructions that differ
only in honesty ("You are an honest assistant." / "You are a deceptive assistant."), so the
pair's activations differ mostly along what the instruction changes. A persistent hook
(`vllm_hook.register_hooks`) records layer L's residual stream for every request the engine
runs. The feature of a request is the mean of that stream over the statement's tokens; a
logistic regression on honest (0) against deceptive (1) features is the probe
(`hidden_state_probe.fit_probe`). Held-out pairs are scored with it. On the tiny model's random
weights the probe separates the training pairs by the instruction tokens alone, which says
nothing about deception: a meaningful probe needs a trained, instruction-following model and
many more pairs.
"""

from __future__ import annotations

import argparse

import torch
from vllm import LLM, SamplingParams

import vllm_hook
from vllm_hook.analyzers.hidden_state_probe import fit_probe
from vllm_hook.testing.tiny_models import tiny_model

INSTRUCTIONS = ("You are an honest assistant.", "You are a deceptive assistant.")
STATEMENTS = ["Paris is the capital of France.", "Berlin is the capital of Germany.",
              "Rome is in Italy.", "The answer is forty two.", "One two three four five.",
              "The quick brown fox jumps over the lazy dog.", "Cats and dogs talk about the weather.",
              "Document two talks about markets."]


def pairs(tok, statements: list[str]) -> list[tuple[list[int], int, int]]:
    """(token ids, label, statement tokens) for each statement behind each instruction: the
    statement is the prompt's last tokens."""
    out = []
    for s in statements:
        st = tok(" " + s, add_special_tokens=False).input_ids
        for label, ins in enumerate(INSTRUCTIONS):
            out.append((tok(ins, add_special_tokens=False).input_ids + st, label, len(st)))
    return out


def recorder(layer: int) -> vllm_hook.Hook:
    """A persistent hook: every forward pass's rows of `layer`'s residual stream."""
    def fn(ctx, h):
        ctx.save("h", h)
    return vllm_hook.Hook(fn, [layer], batched=True)


def features(llm, examples: list[tuple[list[int], int, int]], layer: int) -> torch.Tensor:
    """[n, hidden]: the mean of `layer`'s stream over each example's statement tokens, read by
    a persistent hook (registered for this call, then cleared)."""
    vllm_hook.register_hooks(llm, [recorder(layer)])
    try:
        vllm_hook.clear_hook_results(llm)
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _, _ in examples],
                            SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        got = vllm_hook.collect_hook_results(llm)
    finally:
        vllm_hook.clear_hooks(llm)
        vllm_hook.clear_hook_results(llm)
    rows = []
    for (ids, _, m), o in zip(examples, outs):
        h = torch.cat(got[o.request_id][0]["h"])[:len(ids)]      # the prompt's rows
        rows.append(h[len(ids) - m:].float().mean(0))
    return torch.stack(rows)


def train_and_score(llm, layer: int, train: list[str], test: list[str]):
    """(probe, P(deceptive) of each held-out example, their labels)."""
    tok = llm.get_tokenizer()
    tr, te = pairs(tok, train), pairs(tok, test)
    probe = fit_probe(features(llm, tr, layer), [y for _, y, _ in tr], layer=layer, labels=["honest", "deceptive"])
    p = probe.probabilities(features(llm, te, layer))          # binary: P(label 1), deceptive
    return probe, p, [y for _, y, _ in te]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path or name (default: the tiny qwen2 fixture)")
    ap.add_argument("--layer", type=int, default=2)
    args = ap.parse_args()
    kw = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) if not args.model else {}
    llm = LLM(args.model or tiny_model("qwen2"), additional_config={"vllm_hook": {"hook_layers": [args.layer]}}, **kw)
    probe, p, y = train_and_score(llm, args.layer, STATEMENTS[:6], STATEMENTS[6:])
    for prob, label in zip(p.tolist(), y):
        print(f"{INSTRUCTIONS[label]:34s} P(deceptive) = {prob:.3f}")


if __name__ == "__main__":
    main()
