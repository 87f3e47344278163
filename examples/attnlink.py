"""AttnLink-U schema linking: which candidate columns one attention head links the question
to, read from the prompt's last token (`vllm_hook.analyzers.attnlink`).

    .venv/bin/python examples/attnlink.py                                        # tiny random model, CPU
    .venv/bin/python examples/attnlink.py --model Qwen/Qwen2.5-Coder-7B-Instruct --layer 22 --head 12 --chat

The prompt lists the candidate columns (`column@table`) after the question; `link_prompt`
returns each candidate's exact token span. The analyzer averages the head's attention from
the last prompt token over each span and selects candidates nucleus-style (temperature,
top_p). Zero-shot, but the (layer, head) must be one that links schema items in that model
(MIA: layer 22, head 12 of Qwen2.5-Coder-7B-Instruct); on the tiny model's random weights the
selection is arbitrary.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm import LLM, SamplingParams

import vllm_hook
from vllm_hook import analyzers
from vllm_hook.analyzers.attnlink import link_prompt
from vllm_hook.testing.tiny_models import tiny_model

QUESTION = "What is the average age of singers from France?"
CANDIDATES = ["name@singer", "age@singer", "country@singer", "song_name@song", "year@concert",
              "stadium_id@concert", "capacity@stadium"]


def link(llm, analyzer, question: str = QUESTION, candidates=CANDIDATES, chat: bool = False):
    p = link_prompt(llm.get_tokenizer(), question, candidates, chat_template=chat)
    sp = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"vllm_hook": {"capture": [analyzer.capture_spec()]}})
    out = llm.generate([{"prompt_token_ids": p.token_ids}], sp, use_tqdm=False)[0]
    return analyzer.analyze(vllm_hook.results(out), p.spans, candidates), p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path or name (default: the tiny qwen2 fixture)")
    ap.add_argument("--config", default=str(Path(__file__).parent / "configs" / "attnlink.tiny-qwen2.json"))
    ap.add_argument("--layer", type=int)
    ap.add_argument("--head", type=int)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    args = ap.parse_args()
    over = {k: v for k, v in (("layer", args.layer), ("head", args.head)) if v is not None}
    analyzer = analyzers.get("attnlink")(args.config, **over)
    kw = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) if not args.model else {}
    # attn_scores needs q captured at the head's layer.
    llm = LLM(args.model or tiny_model("qwen2"),
              additional_config={"vllm_hook": {"sites": ["resid_post", "resid_pre", "q"],
                                               "site_layers": [analyzer.config.layer]}}, **kw)
    r, _ = link(llm, analyzer, chat=args.chat)
    for i in r.ranking:
        mark = "*" if i in r.selected else " "
        print(f"{mark} {r.candidates[i]:22s} score {r.scores[i]:.4f}  p {r.probabilities[i]:.3f}")
    print("selected:", r.selected_names)


if __name__ == "__main__":
    main()
