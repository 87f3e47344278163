"""Run prompts through a fresh engine and print JSON (used in a subprocess by the tests).

    python -m tests.helpers.plain_generate ARCH '{"llm kwargs"}' '[[ids], ...]' MAX_TOKENS
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    arch, kwargs, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    from vllm import LLM, SamplingParams

    from vllm_hook.testing.tiny_models import tiny_model

    llm = LLM(tiny_model(arch), **kwargs)
    # A spec is passed on purpose: with the plugin disabled it must be ignored entirely.
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                        extra_args={"vllm_hook": {"capture": [{"layers": "all"}]}})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    from vllm.v1.engine.input_processor import InputProcessor

    print("RESULT " + json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "has_results": [hasattr(o, "vllm_hook") for o in outs],
        "patched": getattr(InputProcessor.process_inputs, "__vllm_hook__", False),
        "disabled_env": os.environ.get("VLLM_HOOK_DISABLE"),
    }))


if __name__ == "__main__":
    main()
