"""Steering for instruction following and for the output language: a contrastive direction
from prompts with and without an instruction, applied to prompts that lack it.

    .venv/bin/python examples/instruction_steering.py                       # tiny random model, CPU
    .venv/bin/python examples/instruction_steering.py --config examples/configs/language_steering.json \\
        --instruction "Answer in French."
    .venv/bin/python examples/instruction_steering.py --model microsoft/Phi-3-mini-4k-instruct --layer 8 \\
        --save phi3_format.safetensors

The method (Stolfo et al., "Improving Instruction-Following in Language Models through
Activation Steering", ICLR 2025; IBM vLLM-Hook ships demos of both uses), in our words: each
base query goes behind the instruction and without it, and the normalised mean difference of
the residual streams at the last prompt token is the instruction's direction
(`analyzers/steering_vectors.py`). `adjust_rs` (the instruction-following config) sets every
token's projection on it to the mean projection of the instructed prompts. `add_vector` with
`positions: last_token` (the language config) adds a multiple of it at the last prompt token
and every generated token. Both are ordinary steering ops in the request's spec, so steered
and plain requests share a batch. On the tiny model's random weights the generations change
but say nothing; a meaningful direction needs a trained instruction-following model, its chat
template, and a few dozen queries.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm import LLM, SamplingParams

from vllm_hook.analyzers.steering_vectors import Direction, SteeringConfig, contrastive_direction, steer_ops_from_config
from vllm_hook.testing.tiny_models import tiny_model

QUERIES = ["Tell me about the weather.", "What is the capital of France?", "Describe a cat.",
           "How do markets work?", "Name three colours.", "Why is the sky blue?"]


def prompt_pairs(tok, instruction: str, queries: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of each query with the instruction appended, and without it."""
    with_i = [tok(f"{q} {instruction}").input_ids for q in queries]
    without = [tok(q).input_ids for q in queries]
    return with_i, without


def build(llm, instruction: str, layer: int, queries: list[str] = QUERIES) -> Direction:
    return contrastive_direction(llm, *prompt_pairs(llm.get_tokenizer(), instruction, queries), layer)


def generate(llm, prompts: list[list[int]], ops: list[dict] | None, max_tokens: int = 16):
    extra = {"vllm_hook": {"steer": ops}} if ops else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path or name (default: the tiny qwen2 fixture)")
    ap.add_argument("--config", default=str(Path(__file__).parent / "configs" / "instruction_steering.json"),
                    help="method, layer, coefficient, positions (SteeringConfig)")
    ap.add_argument("--layer", type=int, help="overrides the config's layer")
    ap.add_argument("--instruction", default="Answer in exactly three bullet points.")
    ap.add_argument("--save", help="write the direction (safetensors) here")
    ap.add_argument("--load", help="use this saved direction instead of building one")
    args = ap.parse_args()
    cfg = SteeringConfig.load(args.config)
    if args.layer is not None:
        cfg = cfg.model_copy(update={"layer": args.layer})
    kw = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) if not args.model else {}
    # adjust_rs is a projection op: its layer must be a projection layer.
    llm = LLM(args.model or tiny_model("qwen2"),
              additional_config={"vllm_hook": {"projection_layers": [cfg.layer]}}, **kw)
    d = Direction.load(args.load) if args.load else build(llm, args.instruction, cfg.layer)
    if args.save:
        d.save(args.save)
    tok = llm.get_tokenizer()
    prompts = [tok(q).input_ids for q in ["Write about the sea.", "Explain gravity."]]
    plain = generate(llm, prompts, None)
    steered = generate(llm, prompts, steer_ops_from_config(d, cfg))
    print(f"direction at layer {cfg.layer}: avg_proj {d.avg_proj:.3f}; {cfg.method}, {cfg.positions}")
    for p, a, b in zip(prompts, plain, steered):
        print(f"\n{tok.decode(p)!r}\n  plain:   {tok.decode(a)!r}\n  steered: {tok.decode(b)!r}")


if __name__ == "__main__":
    main()
