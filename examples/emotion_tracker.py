"""Emotion tracker: per-token emotion scores along directions fitted from example texts, as an
interactive HTML page and a PNG (`vllm_hook.analyzers.emotion_tracker`).

    .venv/bin/python examples/emotion_tracker.py --html emotions.html        # tiny random model, CPU
    .venv/bin/python examples/emotion_tracker.py --model Qwen/Qwen2.5-1.5B-Instruct --layer 14 \\
        --prompt "My dog died this morning and" --max-tokens 48 --html emotions.html --png emotions.png

Each emotion's direction is the mean residual stream (after `--layer`, averaged over the
tokens of each example) of its examples minus that of the neutral ones; a token's score is its
stream's projection on the direction, minus the examples' mean projection. One request reads
the prompt's and the generated tokens' streams (a `resid_post` capture of one layer), so the
page shows how the scores move while the model writes. The examples below are a toy set: use
a few dozen texts per emotion on a trained model (a middle layer works best); on random weights
the directions are arbitrary and the page shows only that the machinery works.
"""

from __future__ import annotations

import argparse

from vllm import LLM, SamplingParams

import vllm_hook
from vllm_hook.analyzers.emotion_tracker import EmotionTracker, emotion_features, fit_directions, mean_token_streams
from vllm_hook.testing.tiny_models import tiny_model

EXAMPLES = {
    "joy": ["What a wonderful day, I am so happy!", "We won the game and everyone cheered with delight.",
            "She laughed with joy when she opened the gift."],
    "anger": ["I am furious that they lied to me again.", "He slammed the door, shouting in rage.",
              "This is outrageous and I will not stand for it!"],
    "sadness": ["I miss her so much, everything feels empty.", "He cried alone after the funeral.",
                "The letter brought nothing but sorrow and grief."],
    "fear": ["I heard footsteps behind me in the dark and froze.", "My hands shook as the storm tore the roof.",
             "She was terrified that they would find her."],
}
NEUTRAL = ["The meeting is at ten in the second room.", "Water boils at one hundred degrees.",
           "The train leaves from platform four.", "The report has three sections and a table."]


def fit(llm, layer: int, examples=EXAMPLES, neutral=NEUTRAL):
    """The emotion directions at `layer`, contrasted with the neutral texts."""
    tok = llm.get_tokenizer()
    feats = emotion_features(llm, {k: [tok(t).input_ids for t in v] for k, v in examples.items()}, layer)
    return fit_directions(feats, layer, neutral=mean_token_streams(llm, [tok(t).input_ids for t in neutral], layer))


def track(llm, tracker: EmotionTracker, prompt_ids: list[int], max_tokens: int):
    """(trace, output, token texts): the scores of every prompt and generated token the model ran."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                        extra_args={"vllm_hook": {"capture": [tracker.capture_spec()]}})
    out = llm.generate([{"prompt_token_ids": prompt_ids}], sp, use_tqdm=False)[0]
    trace = tracker.analyze(vllm_hook.results(out))
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    tok = llm.get_tokenizer()
    return trace, out, [tok.decode([ids[int(p)]]) for p in trace.positions]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path or name (default: the tiny qwen2 fixture)")
    ap.add_argument("--layer", type=int, default=2, help="0-based decoder layer (a middle one on a real model)")
    ap.add_argument("--prompt", default="I waited all year for this trip, and then the flight was cancelled")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--html", help="write the interactive page here")
    ap.add_argument("--png", help="write the emotions x tokens heatmap here")
    ap.add_argument("--save", help="write the directions (safetensors) here")
    args = ap.parse_args()
    kw = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) if not args.model else {}
    llm = LLM(args.model or tiny_model("qwen2"), **kw)
    directions = fit(llm, args.layer)
    if args.save:
        directions.save(args.save)
    tracker = EmotionTracker(directions=directions)
    trace, out, words = track(llm, tracker, llm.get_tokenizer()(args.prompt).input_ids, args.max_tokens)
    print("generated:", repr(out.outputs[0].text))
    for name, row in zip(trace.names, trace.scores.T):
        print(f"{name:>8}: mean {row.mean():+.3f}  max {row.max():+.3f} at {words[int(row.argmax())]!r}")
    if args.html:
        print("wrote", trace.to_html(args.html, words, title=f"Emotion tracker, layer {args.layer}"))
    if args.png:
        print("wrote", trace.plot(args.png, words))


if __name__ == "__main__":
    main()
