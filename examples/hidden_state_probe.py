"""A linear probe on captured residual vectors, through a real vLLM engine.

    .venv/bin/python examples/hidden_state_probe.py                 # tiny random model, CPU
    .venv/bin/python examples/hidden_state_probe.py --model Qwen/Qwen2-1.5B-Instruct --layer 14

Fits a logistic-regression probe (questions vs statements) on the last prompt token's
resid_post at one layer, saves it (safetensors + JSON config), loads it back as the
`hidden_state_probe` analyzer and applies it to every prompt token of new requests. On the
tiny fixture model the weights are random: the probe can fit its training set, but what it
"detects" means nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from vllm import LLM, SamplingParams

import vllm_hook
from vllm_hook import analyzers
from vllm_hook.analyzers import plots
from vllm_hook.testing.tiny_models import tiny_model

STATEMENTS = ["Paris is the capital of France.", "The quick brown fox jumps over the lazy dog.",
              "Berlin is the capital of Germany.", "A model reads tokens and writes tokens.",
              "Rome is in Italy.", "Document two talks about the weather."]
QUESTIONS = ["What is the capital of France?", "What is the answer?", "Is Rome in Italy?",
             "What does document one talk about?", "Is Berlin the capital of Germany?",
             "Can a model read tokens?"]
TESTS = ["Is Paris the capital of France?", "Paris is the capital of France."]


def run(llm, texts, capture):
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"vllm_hook": {"capture": [capture]}})
    outs = llm.generate([{"prompt_token_ids": tok(t).input_ids} for t in texts], params, use_tqdm=False)
    return [vllm_hook.results(o) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path or name (default: the tiny qwen2 fixture)")
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--out-dir", help="where to write the probe (default: a temporary folder)")
    ap.add_argument("--plot-dir", help="write a PNG heatmap here")
    args = ap.parse_args()
    # The tiny CPU model runs eagerly in fp32; a --model keeps vLLM's defaults (CUDA graphs).
    kw = dict(enforce_eager=True, dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) \
        if not args.model else {}
    llm = LLM(args.model or tiny_model("qwen2"), seed=0, **kw)
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="vllm_hook_probe_")

    # 1. Fit: one resid_post row (last prompt token) per labelled prompt.
    last = {"site": "resid_post", "layers": [args.layer], "tokens": "last_prompt"}
    train = run(llm, STATEMENTS + QUESTIONS, last)
    x = analyzers.probe_features(train, layer=args.layer)
    y = [0] * len(STATEMENTS) + [1] * len(QUESTIONS)
    probe = analyzers.fit_probe(x, y, l2=1e-2, layer=args.layer, labels=["statement", "question"])
    train_acc = float(((probe.probabilities(x) >= 0.5).long().numpy() == y).mean())
    weights = probe.save(os.path.join(out_dir, "question_probe.safetensors"))
    config = os.path.join(out_dir, "question_probe.json")
    with open(config, "w") as f:
        json.dump({"analyzer": "hidden_state_probe", "weights": "question_probe.safetensors",
                   "threshold": 0.5}, f, indent=1)
    print(f"probe: layer {args.layer}, train accuracy {train_acc:.2f}, weights {weights}, config {config}")

    # 2. Apply: the analyzer from its config file, on every prompt token of new requests.
    analyzer = analyzers.get("hidden_state_probe")(config)
    tok = llm.get_tokenizer()
    summary = []
    for i, (text, r) in enumerate(zip(TESTS, run(llm, TESTS, analyzer.capture_spec(tokens="prompt")))):
        res = analyzer.analyze(r)
        last = float(res.probabilities[-1])
        print(f"{text!r}: p(question) at the last token {last:.3f} -> {res.labels[int(res.predictions[-1])]}")
        print("    per token:", " ".join(f"{tok.decode([t])!r}:{p:.2f}"
                                        for t, p in zip(r.token_ids, res.probabilities)))
        summary.append({"text": text, **res.to_dict()})
        if args.plot_dir:
            labels = [repr(tok.decode([t])) for t in r.token_ids[:r.prompt_len]]
            path = os.path.join(args.plot_dir, f"hidden_state_probe_{i}.png")
            print("plot:", plots.plot_hidden_state_probe(res, path, token_labels=labels))
    if not args.model:
        print("NOTE: the tiny fixture model has random weights; the probe's outputs mean nothing. Fit it "
              "on a real model's activations for a real detector.")
    print("RESULT " + json.dumps({"train_accuracy": train_acc, "tests": summary}))


if __name__ == "__main__":
    main()
