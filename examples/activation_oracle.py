"""Activation oracle: a model with a LoRA adapter answers questions about an activation that
is injected into its prompt (after Karvonen et al., "Activation Oracles", 2025, as vllm-lens
demonstrates it).

    .venv/bin/python examples/activation_oracle.py                         # tiny model, random LoRA, CPU
    .venv/bin/python examples/activation_oracle.py --model Qwen/Qwen3-8B --lora ORACLE_ADAPTER_DIR --layer 18

The method, in our words: capture the residual stream after layer L at the last token of a
source prompt (plain `capture`). The oracle prompt holds a placeholder token; at that
position, after the same layer, the oracle adds the activation rescaled to the stream's own
norm there (`add` with `norm_match`: h <- h + scale x ||h|| x v / ||v||, our steering op,
`tokens: [position]`), and generates through the oracle's LoRA adapter (vLLM's `LoRARequest`).
Both are ordinary requests: the capture and the injected generation share batches with
anything else. Here the adapter is random and so are the model's weights, so the answer means
nothing; a real oracle needs the trained adapter of its base model.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

import vllm_hook
from vllm_hook.testing.tiny_models import tiny_model

PLACEHOLDER = " ?"


def random_adapter(model_path: str, out_dir: str, rank: int = 4, seed: int = 0) -> str:
    """A LoRA adapter with random (nonzero) weights on q/v projections, saved with PEFT."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = tf.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(out_dir)
    return out_dir


def source_activation(llm, prompt: list[int], layer: int) -> torch.Tensor:
    sp = SamplingParams(max_tokens=1, temperature=0.0,
                        extra_args={"vllm_hook": {"capture": [{"layers": [layer], "tokens": "last_prompt"}]}})
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    return vllm_hook.results(out).activations["resid_post"][layer][-1]


def oracle_prompt(tok, question: str = "What is this activation about?") -> tuple[list[int], int]:
    """(ids, position of the placeholder token)."""
    head = tok("Activation:").input_ids
    mark = tok(PLACEHOLDER, add_special_tokens=False).input_ids
    ids = head + mark + tok(f" {question} Answer:", add_special_tokens=False).input_ids
    return ids, len(head) + len(mark) - 1


def injection(v: torch.Tensor, layer: int, position: int, scale: float = 1.0) -> list[dict]:
    return [{"op": "add", "layer": layer, "vector": v.float().tolist(), "scale": scale, "norm_match": True,
             "tokens": [position]}]


def ask(llm, lora: LoRARequest | None, prompt: list[int], ops: list[dict], max_tokens: int = 8) -> list[int]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                        extra_args={"vllm_hook": {"steer": ops}})
    out = llm.generate([{"prompt_token_ids": prompt}], sp, lora_request=lora, use_tqdm=False)[0]
    vllm_hook.results(out)           # raises if an op could not be applied
    return list(out.outputs[0].token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="base model (default: the tiny qwen2 fixture)")
    ap.add_argument("--lora", help="the oracle's LoRA adapter directory (default: a random one)")
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--source", default="The Eiffel Tower is in Paris.")
    args = ap.parse_args()
    model = args.model or tiny_model("qwen2")
    lora_dir = args.lora or random_adapter(model, tempfile.mkdtemp(prefix="vh_oracle_lora_"))
    kw = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512) if not args.model else {}
    llm = LLM(model, enable_lora=True, max_lora_rank=64, max_loras=1,
              additional_config={"vllm_hook": {"projection_layers": [args.layer]}}, **kw)
    tok = llm.get_tokenizer()
    v = source_activation(llm, tok(args.source).input_ids, args.layer)
    prompt, pos = oracle_prompt(tok)
    lora = LoRARequest("oracle", 1, lora_dir)
    answer = ask(llm, lora, prompt, injection(v, args.layer, pos))
    print(f"source {args.source!r}: activation norm {float(v.norm()):.2f}, injected at position {pos}")
    print("oracle:", repr(tok.decode(answer)))


if __name__ == "__main__":
    main()
