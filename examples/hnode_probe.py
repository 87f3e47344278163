"""The H-Node hallucination probe: a probe over selected hidden coordinates of the last
prompt token, fitted on grounded and hallucinated answers (`vllm_hook.analyzers.hnode`).

    .venv/bin/python examples/hnode_probe.py                        # tiny random model, CPU
    .venv/bin/python examples/hnode_probe.py --model Qwen/Qwen2.5-1.5B-Instruct --save hnode.safetensors

Each question is asked as "Q: question\\nA: answer" once with its correct answer (grounded,
label 0) and once with a wrong one (hallucinated, label 1). One capture per prompt reads every
layer's residual stream at the last token; `fit_hnode` fits a standardised logistic
regression per layer on a training split, keeps the layer of best held-out ROC-AUC, and picks
the H-Nodes (largest positive weights) and their baselines (80th percentile of grounded
activations). The questions below are a toy set: a real probe needs a trained model and a
dataset such as TruthfulQA (MIA's probe: 300 questions, layer 14 of Qwen2.5-1.5B-Instruct, AUC
0.90); on random weights the probe separates the answer tokens, not truth.
"""

from __future__ import annotations

import argparse

from vllm import LLM

from vllm_hook.analyzers.hnode import fit_hnode, last_token_features
from vllm_hook.testing.tiny_models import tiny_model

QA = [("What is the capital of France?", "Paris", "Rome"), ("What is the capital of Italy?", "Rome", "Berlin"),
      ("How many legs has a cat?", "Four", "Seven"), ("What colour is the sky?", "Blue", "Green"),
      ("What is two plus two?", "Four", "Five"), ("Which animal barks?", "A dog", "A fish"),
      ("What is the capital of Germany?", "Berlin", "Paris"), ("What do bees make?", "Honey", "Milk"),
      ("How many days has a week?", "Seven", "Nine"), ("What is frozen water?", "Ice", "Sand"),
      ("Which planet do we live on?", "Earth", "Mars"), ("What colour is grass?", "Green", "Red")]


def dataset(tok, qa=QA, eval_every: int = 3):
    """(prompts, labels, eval_mask): both answers of every `eval_every`-th question held out."""
    prompts, labels, ev = [], [], []
    for i, (q, good, bad) in enumerate(qa):
        for label, a in ((0, good), (1, bad)):
            prompts.append(tok(f"Q: {q}\nA: {a}").input_ids)
            labels.append(label)
            ev.append(i % eval_every == 0)
    return prompts, labels, ev


def fit(llm, n_nodes: int = 8):
    prompts, labels, ev = dataset(llm.get_tokenizer())
    L = llm.llm_engine.model_config.hf_config.num_hidden_layers
    feats = last_token_features(llm, prompts, range(L))
    return fit_hnode(feats, labels, ev, n_nodes=n_nodes), feats, labels, ev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path or name (default: the tiny qwen2 fixture)")
    ap.add_argument("--nodes", type=int, default=8, help="H-Nodes to keep (MIA: 50)")
    ap.add_argument("--save", help="write the probe (safetensors) here")
    args = ap.parse_args()
    kw = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) if not args.model else {}
    llm = LLM(args.model or tiny_model("qwen2"), **kw)
    probe, feats, labels, ev = fit(llm, args.nodes)
    if args.save:
        probe.save(args.save)
    print("held-out AUC per layer:", {k: round(v, 3) for k, v in probe.auc_per_layer.items()})
    s = probe.score(feats[probe.layer])
    print(f"best layer {probe.layer}; H-Nodes {probe.nodes.tolist()}")
    for p, y, e, v in zip(s.probabilities.tolist(), labels, ev, s.verdicts):
        print(f"{'held out' if e else 'train   '}  label {y}  P(hallucinated) {p:.3f}  {v}")


if __name__ == "__main__":
    main()
