"""Science-claim hallucination detector: a classifier on the model's own final hidden state
after it has judged a claim (after the SciHal 2025 shared-task entry "Detecting Hallucinations
in Scientific Claims by Combining Prompting Strategies and Internal State Classification",
as IBM vLLM-Hook/MIA's `science_hallucination` analyzer runs it).

    .venv/bin/python examples/science_hallucination.py                          # tiny random model, CPU
    .venv/bin/python examples/science_hallucination.py --model meta-llama/Llama-3.1-8B-Instruct --max-tokens 1024

The method, in our words: the model reads a claim and its reference behind a few-shot prompt
and answers greedily (pass 1). The prompt plus its answer without the last two tokens is then
prefilled (pass 2), and the feature is the last layer's output at the last token after the
model's final norm: what HF's `generate` exposes as the last hidden state of the step that
produced the answer's second-to-last token. A read-only hook at the last layer computes it in
the engine (`ctx.final_norm`). A logistic regression over the features gives one of three
labels: entailment, contradiction, unverifiable (`hidden_state_probe.fit_probe`). The claims
below are a toy set and the tiny model's weights are random: a real detector needs the
shared task's training claims, the model it was fitted on, and its classifier (MIA does not
ship one).
"""

from __future__ import annotations

import argparse

import torch
from vllm import LLM, SamplingParams

import vllm_hook
from vllm_hook.analyzers.hidden_state_probe import fit_probe
from vllm_hook.testing.tiny_models import tiny_model

LABELS = ("entailment", "contradiction", "unverifiable")
SHOT = ("#Claim: Water boils at 100 C at sea level.\n#Reference: At one atmosphere water boils at 100 C.\n"
        "Output: the reference states it. #Label: entailment\n")
CLAIMS = [("Cells contain DNA.", "DNA is found in the nucleus of cells.", 0),
          ("The moon is made of rock.", "Lunar samples are basaltic rock.", 0),
          ("Light is slower than sound.", "Light travels faster than sound.", 1),
          ("Ice is hotter than steam.", "Steam is hotter than ice.", 1),
          ("Mars has rings.", "Mars has two small moons.", 2),
          ("Bees sleep at night.", "Bees collect nectar from flowers.", 2),
          ("Iron rusts in water.", "Iron oxidises when wet.", 0),
          ("Plants make oxygen.", "Animals breathe out carbon dioxide.", 2),
          ("The sun orbits the earth.", "The earth orbits the sun.", 1)]


def prompt_ids(tok, claim: str, reference: str) -> list[int]:
    text = (f"Decide whether the reference supports the claim: entailment, contradiction or unverifiable.\n"
            f"{SHOT}Input: #Claim: {claim}\n#Reference: {reference}\nOutput:")
    return tok(text).input_ids


def final_state_hook(last_layer: int) -> vllm_hook.Hook:
    """Read-only: after the last layer, the final norm of each request's last row of every
    forward pass (saved["x"], one row per pass)."""
    def fn(ctx, h):
        ends = torch.tensor([a + n - 1 for a, n in ctx.segments], device=h.device)
        ctx.save("x", ctx.final_norm(h.index_select(0, ends)).float(), per_request=True)
    return vllm_hook.Hook(fn, [last_layer], batched=True, read_only=True, name="final_state")


def features(llm, prompts: list[list[int]], max_tokens: int = 8) -> tuple[torch.Tensor, list[list[int]]]:
    """([n, hidden] features, each prompt's pass-1 answer)."""
    L = llm.llm_engine.model_config.hf_config.num_hidden_layers
    answers = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)]
    second = [p + a[:-2] for p, a in zip(prompts, answers)]
    hook = final_state_hook(L - 1)
    sp = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"vllm_hook": {"hooks": [hook]}})
    outs = llm.generate([{"prompt_token_ids": p} for p in second], sp, use_tqdm=False)
    # One token to generate: no decode pass, so the last pass's row is the last prompt token.
    rows = [vllm_hook.results(o).hook_results[0]["x"][-1][-1] for o in outs]
    return torch.stack(rows), answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path or name (default: the tiny qwen2 fixture)")
    ap.add_argument("--max-tokens", type=int, default=8, help="pass 1's answer length (MIA: 1024)")
    args = ap.parse_args()
    kw = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) if not args.model else {}
    llm = LLM(args.model or tiny_model("qwen2"), additional_config={"vllm_hook": {"hook_layers": [-1]}}, **kw)
    tok = llm.get_tokenizer()
    x, _ = features(llm, [prompt_ids(tok, c, r) for c, r, _ in CLAIMS], args.max_tokens)
    y = [lab for _, _, lab in CLAIMS]
    probe = fit_probe(x[:6], y[:6], labels=list(LABELS))
    pred = probe.probabilities(x[6:]).argmax(-1).tolist()
    for (claim, _, lab), p in zip(CLAIMS[6:], pred):
        print(f"{claim:32s} label {LABELS[lab]:13s} predicted {LABELS[p]}")


if __name__ == "__main__":
    main()
