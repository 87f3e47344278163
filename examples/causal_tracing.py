"""ROME-style causal tracing with Python hooks: which (layer, token) states carry a fact.

    .venv/bin/python examples/causal_tracing.py                    # tiny random model, CPU
    .venv/bin/python examples/causal_tracing.py --model gpt2-xl-like/model --subject "Eiffel Tower" \
        --prompt "The Eiffel Tower is in the city of" --png trace.png --html trace.html

The method (Meng et al., 2022, in our words): run the prompt clean and record the residual
stream at every layer and token; run it again with noise added to the subject tokens'
embeddings (a pre-hook on layer 0), which lowers the probability of the clean answer; then,
for every layer L and token t, run the corrupted prompt once more with the clean state of
(L, t) put back (a post hook on layer L). The probability the answer recovers is that state's
indirect effect. Every run is one request of a single batch: 2 + layers x tokens requests,
side by side in vLLM's continuous batch; a read-only hook on the last layer reads the
answer's probability (final norm, unembedding). With the tiny model's random weights the map
is meaningless but exact: the test recomputes it with the same hooks on Hugging Face.
"""

from __future__ import annotations

import argparse

import torch
from vllm import LLM, SamplingParams

import vllm_hook
from vllm_hook import Hook
from vllm_hook.testing.tiny_models import tiny_model


def corrupt_hook(positions: list[int], noise: torch.Tensor) -> Hook:
    """Pre-hook on layer 0: noise[i] added to the embedding at positions[i]."""
    where = {p: i for i, p in enumerate(positions)}

    def fn(ctx, h):
        rows = [(r, where[p]) for r, p in enumerate(ctx.positions.tolist()) if p in where]
        if not rows:
            return None
        out = h.clone()
        out[[r for r, _ in rows]] += noise[[i for _, i in rows]].to(h)
        return out
    return Hook(fn, [0], pre=True)


def restore_hook(layer: int, position: int, state: torch.Tensor) -> Hook:
    """Post hook on `layer`: the row at `position` set to the clean `state`."""
    def fn(ctx, h):
        pos = ctx.positions.tolist()
        if position not in pos:
            return None
        out = h.clone()
        out[pos.index(position)] = state.to(h)
        return out
    return Hook(fn, [layer])


def answer_prob_hook(num_layers: int, answer: int) -> Hook:
    """Read-only, last layer: the answer's probability at the last prompt token."""
    def fn(ctx, h):
        pos = ctx.positions.tolist()
        if ctx.prompt_len - 1 in pos:
            x = ctx.final_norm(h[pos.index(ctx.prompt_len - 1)][None])
            logits = torch.nn.functional.linear(x, ctx.get_parameter("lm_head.weight"))
            ctx.saved["p"] = logits.float().softmax(-1)[0, answer]
    return Hook(fn, [num_layers - 1])


def noise_for(n: int, hidden: int, scale: float, seed: int = 0) -> torch.Tensor:
    return scale * torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


def trace(llm, ids: list[int], subject: list[int], answer: int, noise: torch.Tensor) -> dict:
    """{"clean": p, "corrupted": p, "restored": [layers, tokens]} of the answer's probability."""
    n = llm.llm_engine.model_config.hf_config.num_hidden_layers
    read = answer_prob_hook(n, answer)
    corrupt = corrupt_hook(subject, noise)
    P = len(ids)

    def params(hooks, capture=None):
        spec = {"hooks": hooks + [read], **({"capture": capture} if capture else {})}
        return SamplingParams(max_tokens=1, temperature=0.0, extra_args={"vllm_hook": spec})

    clean, corrupted = llm.generate([{"prompt_token_ids": ids}] * 2,
                                    [params([], [{"layers": "all", "tokens": "prompt"}]), params([corrupt])],
                                    use_tqdm=False)
    states = vllm_hook.results(clean).activations["resid_post"]
    runs = [(L, t) for L in range(n) for t in range(P)]
    outs = llm.generate([{"prompt_token_ids": ids}] * len(runs),
                        [params([corrupt, restore_hook(L, t, states[L][t])]) for L, t in runs],
                        use_tqdm=False)
    restored = torch.zeros(n, P)
    for (L, t), o in zip(runs, outs):
        restored[L, t] = vllm_hook.results(o).hook_results[-1]["p"]
    p = [float(vllm_hook.results(o).hook_results[-1]["p"]) for o in (clean, corrupted)]
    return {"clean": p[0], "corrupted": p[1], "restored": restored, "states": states}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path or name (default: the tiny qwen2 fixture)")
    ap.add_argument("--prompt", default="Paris is the capital of France")
    ap.add_argument("--subject", default="Paris")
    ap.add_argument("--noise", type=float, default=3.0, help="noise std in units of the embeddings' std")
    ap.add_argument("--png", help="write the layers x tokens heatmap here")
    ap.add_argument("--html", help="write the interactive layers x tokens view here (a self-contained page)")
    args = ap.parse_args()
    kw = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) if not args.model else {}
    llm = LLM(args.model or tiny_model("qwen2"), additional_config={"vllm_hook": {"hook_layers": "all"}}, **kw)
    tok = llm.get_tokenizer()
    ids = tok(args.prompt).input_ids
    sub = tok(args.subject, add_special_tokens=False).input_ids
    start = next(i for i in range(len(ids)) if ids[i:i + len(sub)] == sub)
    subject = list(range(start, start + len(sub)))
    first = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0),
                         use_tqdm=False)[0]
    answer = first.outputs[0].token_ids[0]
    hidden = llm.llm_engine.model_config.get_hidden_size()
    emb_std = 1.0   # the tiny model's embeddings; a real one: measure, e.g. over a corpus
    res = trace(llm, ids, subject, answer, noise_for(len(subject), hidden, args.noise * emb_std))
    print(f"answer {tok.decode([answer])!r}: clean p={res['clean']:.4f}, corrupted p={res['corrupted']:.4f}")
    best = divmod(int(res["restored"].argmax()), res["restored"].shape[1])
    print(f"strongest restoration: layer {best[0]}, token {best[1]} -> p={float(res['restored'].max()):.4f}")
    words = [tok.decode([i]) + ("*" if i_ in subject else "") for i_, i in enumerate(ids)]
    if args.png:
        from vllm_hook.analyzers import plots

        print("wrote", plots.plot_layers_by_tokens(res["restored"] - res["corrupted"], args.png, words,
                                                   "causal tracing: restored - corrupted", "indirect effect"))
    if args.html:
        print("wrote", html_view(res, words, args.html))


def html_view(res: dict, words: list[str], path: str) -> str:
    """The layers x tokens indirect effects as an interactive page (subject tokens marked *)."""
    from vllm_hook.analyzers.html import heatmap_view

    effect = (res["restored"] - res["corrupted"]).numpy()
    return heatmap_view(path, effect, [f"layer {L}" for L in range(effect.shape[0])], words,
                        title=f"Causal tracing (clean p={res['clean']:.4f}, corrupted p={res['corrupted']:.4f})",
                        label="indirect effect")


if __name__ == "__main__":
    main()
