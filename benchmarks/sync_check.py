"""Where a hooked decode step makes the host wait for the GPU (issue 16).

    source scripts/gpu_env.sh && python3 benchmarks/sync_check.py --out $OUT/sync

A sync in a hook (or in the plugin around it) stops the host from queueing ahead of the GPU:
the step's host and GPU time add up instead of overlapping. One in-process engine (so the
worker is in this process), torch's sync debug mode on in the worker, then a few requests per
workload; every synchronizing call is reported once per code location with its stack.
Writes syncs.json and prints them.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # the worker runs in this process

from run import bench_parser, model_and_base, tracker_layers  # noqa: E402

SEEN: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
STACKS: dict[str, str] = {}
CURRENT = ["startup"]


def _show(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" not in str(message):
        return
    stack = [f for f in traceback.extract_stack()[:-1] if "warnings.py" not in f.filename]
    where = next((f"{f.filename}:{f.lineno}" for f in reversed(stack) if "vllm_hook" in f.filename), f"{filename}:{lineno}")
    SEEN[CURRENT[0]][where] += 1
    STACKS.setdefault(where, "".join(traceback.format_list(stack[-12:])))


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, base = model_and_base(args, max_num_seqs=64)
    from vllm import LLM, SamplingParams

    import torch

    cfg = json.loads((Path(model) / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    four, mid = tracker_layers(L), L // 2
    llm = LLM(model=model, **base, additional_config={"vllm_hook": {"hook_layers": sorted({*four, mid})}})
    specs = {
        "unused": None,
        "logit_lens_4_layers": {"hooks": [{"name": "logit_lens", "args": {"layers": four, "k": 5}}]},
        "modify_1_layer": {"hooks": [{"name": "zero_dims", "args": {"layers": [mid], "dims": [0, 1, 2, 3]}}]},
        "steer_add_all_layers": {"steer": [{"op": "add", "layer": x, "vector": [0.01] * cfg["hidden_size"]}
                                           for x in range(L)]},
        "capture_last_prompt_4_layers": {"capture": [{"layers": four, "tokens": "last_prompt"}]},
    }
    warnings.showwarning = _show
    warnings.simplefilter("always")
    on_device = torch.cuda.is_available()

    def debug(mode):
        def f(self=None):
            import torch
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(mode)
        return f

    prompts = [{"prompt_token_ids": list(range(10 + i, 74 + i))} for i in range(16)]
    for name, spec in specs.items():
        sp = SamplingParams(max_tokens=16, ignore_eos=True,
                            extra_args={"vllm_hook": spec} if spec else None)
        llm.generate(prompts, sp, use_tqdm=False)            # warm: first-use allocations
        CURRENT[0] = name
        if on_device:
            llm.collective_rpc(debug("warn"))
        llm.generate(prompts, sp, use_tqdm=False)
        if on_device:
            llm.collective_rpc(debug("default"))
        CURRENT[0] = "between"
        print(f"{name}: {sum(SEEN[name].values())} syncs at {len(SEEN[name])} places", flush=True)
    report = {w: {k: {"count": n, "stack": STACKS[k]} for k, n in c.most_common()} for w, c in SEEN.items()}
    (out / "syncs.json").write_text(json.dumps(report, indent=1))
    for w, c in SEEN.items():
        print(f"== {w}")
        for k, n in c.most_common(12):
            print(f"  {n:6d}  {k}\n{STACKS[k]}")


if __name__ == "__main__":
    main()
