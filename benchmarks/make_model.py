"""Random-weight bf16 checkpoints with the shapes of real models, built on the machine.

Random weights are fine for speed and memory; nothing here needs a trained model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SHAPES = {
    # Qwen2-1.5B: 28 layers, hidden 1536, 12 heads / 2 KV heads (head 128), MLP 8960.
    "qwen2-1.5b": dict(arch="Qwen2ForCausalLM", model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                       num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0),
    # The same with a 512-token vocabulary and the tiny fixture tokenizer: for end-to-end checks
    # that send text (served mode); random ids of a 152k vocabulary would not detokenize.
    "qwen2-1.5b-v512": dict(arch="Qwen2ForCausalLM", model_type="qwen2", hidden_size=1536,
                            intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
                            rope_theta=1000000.0),
    # Llama-3-8B: 32 layers, hidden 4096, 32 heads / 8 KV heads, MLP 14336.
    "llama-8b": dict(arch="LlamaForCausalLM", model_type="llama", hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
}


def build(shape: str, root: str) -> str:
    import torch
    import transformers as tf

    out = Path(root) / shape
    if (out / ".complete").exists():
        return str(out)
    s = dict(SHAPES[shape])
    arch = s.pop("arch")
    mtype = s.pop("model_type")
    cfg_cls = tf.Qwen2Config if mtype == "qwen2" else tf.LlamaConfig
    cfg = cfg_cls(**s, max_position_embeddings=32768, rms_norm_eps=1e-6, architectures=[arch],
                  bos_token_id=1, eos_token_id=2, initializer_range=0.02)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    if cfg.vocab_size <= 512:
        from vllm_hook.testing.tiny_models import build_tokenizer

        build_tokenizer(out)
    (out / ".complete").write_text("ok")
    del model
    return str(out)


if __name__ == "__main__":
    import sys

    print(build(sys.argv[1] if len(sys.argv) > 1 else "qwen2-1.5b", os.environ.get("VH_MODELS", "/tmp/vh_models")))
