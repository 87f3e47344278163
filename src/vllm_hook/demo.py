"""Capture and steering, per request, in one vLLM batch, on a built-in tiny model (CPU).

    python -m vllm_hook.demo [--arch qwen2] [--eager]

The model has random weights: its text is gibberish, but what the demo shows does not need a
trained model: each request in the batch gets its own captures and steering, a request that
asks for nothing is unaffected, and results come back as tensors (and as a safetensors file).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen2", help="tiny fixture architecture (llama, qwen2, qwen3, gemma2)")
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (faster start, no torch.compile)")
    args = ap.parse_args(argv)

    import torch
    from vllm import LLM, SamplingParams

    import vllm_hook
    from vllm_hook.testing.tiny_models import tiny_model

    path = tiny_model(args.arch)
    print(f"[demo] tiny random {args.arch} checkpoint: {path}")
    t0 = time.time()
    # Opt-in features used below: attn_out capture and projection ops (ablate).
    hook_config = {"sites": ["resid_post", "resid_pre", "attn_out"], "projection_layers": "all"}
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_seqs=8,
              kv_cache_memory_bytes=64 << 20, enforce_eager=args.eager,
              additional_config={"vllm_hook": hook_config})
    print(f"[demo] engine ready in {time.time() - t0:.0f} s "
          f"({'eager' if args.eager else 'torch.compile'}, vLLM {__import__('vllm').__version__})")

    from vllm_hook.adapters.requests import model_config_of

    hidden = model_config_of(llm).get_hidden_size()
    direction = torch.randn(hidden, generator=torch.Generator().manual_seed(7))
    vllm_hook.register_vectors(llm, {"demo_direction": direction})

    prompt = "Paris is the capital of France. Berlin is the capital of"
    requests = {
        "plain (no spec)": None,
        "capture resid_post, all layers, last prompt token + generated": {
            "capture": [{"layers": "all", "tokens": "last_prompt"},
                        {"layers": [-1], "tokens": "generated"}]},
        "steer: add 8 x demo_direction after layer 1": {
            "steer": [{"op": "add", "layer": 1, "vector": "demo_direction", "scale": 8.0}],
            "capture": [{"layers": [1], "tokens": "last_prompt"}]},
        "steer: ablate demo_direction at every layer, capture attn_out": {
            "steer": [{"op": "ablate", "layer": L, "vector": "demo_direction"} for L in range(2)],
            "capture": [{"layers": [0, 1], "site": "attn_out", "tokens": "last"}],
            "save": {"dir": tempfile.mkdtemp(prefix="vllm_hook_demo_")}},
    }
    params = [SamplingParams(max_tokens=12, temperature=0.0,
                             extra_args={"vllm_hook": spec} if spec else None) for spec in requests.values()]
    t0 = time.time()
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    print(f"[demo] one batch of {len(outs)} requests in {time.time() - t0:.2f} s\n")

    alone = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
    for (name, spec), out in zip(requests.items(), outs):
        toks = list(out.outputs[0].token_ids)
        print(f"== {name}\n   tokens: {toks}")
        if spec is None:
            same = toks == list(alone.outputs[0].token_ids)
            print(f"   same tokens as the same prompt run alone without the plugin's help: {same}")
            continue
        r = vllm_hook.results(out)
        for site, per_layer in r.activations.items():
            for layer, t in per_layer.items():
                pos = r.positions[site][layer].tolist()
                print(f"   {site:10s} layer {layer}: {tuple(t.shape)} float32, positions {pos}, "
                      f"norms {[round(x, 2) for x in t.norm(dim=-1).tolist()][:4]}")
        if r.path:
            back = vllm_hook.Results.load(r.path)
            print(f"   saved to {r.path} ({os.path.getsize(r.path)} bytes; reloads: "
                  f"{sorted(back.activations)})")
    print("\n[demo] steering changed the text of the steered requests only:",
          [list(o.outputs[0].token_ids) != list(alone.outputs[0].token_ids) for o in outs])


if __name__ == "__main__":
    main()
