"""CoRe / in-context re-ranking (ICR) of documents through a real vLLM engine.

    .venv/bin/python examples/core_reranker.py                  # tiny random model, CPU
    .venv/bin/python examples/core_reranker.py --model meta-llama/Llama-3.1-8B-Instruct --plot-dir out/

One prompt holds the documents then the query; the query tokens' attention to each document
scores it. A second request with the content-free query "N/A" calibrates away the model's
positional bias (ICR). Both requests run in one batch. On the tiny fixture model the weights
are random: the scores are real numbers, the ranking is not meaningful.
"""

from __future__ import annotations

import argparse
import json
import os

from vllm import LLM, SamplingParams

import vllm_hook
from vllm_hook import analyzers
from vllm_hook.analyzers import plots
from vllm_hook.testing.tiny_models import tiny_model

QUERY = "What is the capital of France?"
DOCS = ["Document one talks about cats and dogs.",
        "Paris is the capital of France.",
        "Berlin is the capital of Germany.",
        "Document three talks about markets and the weather."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path or name (default: the tiny qwen2 fixture)")
    ap.add_argument("--config", help="a core_reranker JSON config (default: every head, ICR prompt)")
    ap.add_argument("--plot-dir", help="write a PNG heatmap here")
    args = ap.parse_args()
    # The tiny CPU model runs eagerly in fp32; a --model keeps vLLM's defaults (CUDA graphs).
    kw = dict(enforce_eager=True, dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) \
        if not args.model else {}
    llm = LLM(args.model or tiny_model("qwen2"), seed=0, **kw,
              # attn_scores are computed from the captured queries: the engine must instrument q.
              additional_config={"vllm_hook": {"sites": ["resid_post", "resid_pre", "q"]}})
    tok = llm.get_tokenizer()

    rr = analyzers.get("core_reranker")(args.config)
    prompt = rr.prompt(tok, QUERY, DOCS)
    calib = rr.calibration_prompt(tok, DOCS)
    params = [SamplingParams(max_tokens=1, temperature=0.0,
                             extra_args={"vllm_hook": {"capture": [rr.capture_spec(p.query_span)]}})
              for p in (prompt, calib)]
    outs = llm.generate([{"prompt_token_ids": p.token_ids} for p in (prompt, calib)], params, use_tqdm=False)
    res, res_cal = (vllm_hook.results(o) for o in outs)

    plain = rr.analyze(res, prompt.doc_spans, prompt.query_span)
    ranked = rr.analyze(res, prompt.doc_spans, prompt.query_span, calibration=res_cal,
                        calibration_query_span=calib.query_span)
    print(f"query: {QUERY!r}  ({len(prompt.token_ids)} prompt tokens, query span {prompt.query_span}, "
          f"{len(ranked.heads)} heads)")
    for rank, d in enumerate(ranked.ranking, 1):
        print(f"  #{rank}  score {ranked.scores[d]:+.5f}  (uncalibrated {plain.scores[d]:.4f})  "
              f"doc {d} {prompt.doc_spans[d]}: {DOCS[d]}")
    if args.plot_dir:
        print("plot:", plots.plot_core_reranker(ranked, os.path.join(args.plot_dir, "core_reranker.png"),
                                                doc_labels=[d[:32] for d in DOCS]))
    if not args.model:
        print("NOTE: the tiny fixture model has random weights; this ranking means nothing. Use a real "
              "instruction-tuned model for real re-ranking.")
    print("RESULT " + json.dumps({"calibrated": ranked.to_dict(), "uncalibrated": plain.to_dict()}))


if __name__ == "__main__":
    main()
