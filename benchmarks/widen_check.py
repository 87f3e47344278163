"""Rows widened on the device equal the model dtype's rows widened, bit for bit (issue 17).

    source scripts/gpu_env.sh && python3 benchmarks/widen_check.py --model DIR --out $OUT/widen

An offline float32 capture whose rows all come from the prompt is converted on the device
before its copy to the host (wire "W", `delivery.collector`). One bf16 engine (CUDA graphs on
a GPU), batches of one-token requests capturing every token at 4 layers in float32, beside
the same prompts in the model's dtype, and a batch mixing both (its blocks stay bf16, the
frontend widens). Writes check.json: every comparison and the workers' `blocks_widened`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from run import bench_parser, model_and_base, tracker_layers  # noqa: E402


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, base = model_and_base(args, max_num_seqs=64)
    if args.smoke:
        base["dtype"] = "bfloat16"
    import torch
    from vllm import LLM, SamplingParams

    import vllm_hook

    L = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    llm = LLM(model=model, **base)
    cap = {"capture": [{"layers": tracker_layers(L), "tokens": "all"}]}
    prompts = [{"prompt_token_ids": list(range(10 + i, 10 + i + 64 + 7 * i))} for i in range(24)]

    def run(specs):
        outs = llm.generate(prompts[:len(specs)], [SamplingParams(max_tokens=1, extra_args={"vllm_hook": s})
                                                    for s in specs], use_tqdm=False)
        return [vllm_hook.results(o) for o in outs]

    def widened():
        return vllm_hook.stats(llm)["blocks_widened"]

    def same(wide, narrow):
        return all(wide.activations[s][x].dtype == torch.float32
                   and torch.equal(wide.activations[s][x], narrow.activations[s][x].float())
                   for s in narrow.activations for x in narrow.activations[s])

    n = len(prompts)
    narrow = run([{**cap, "dtype": "model"}] * n)
    report = {}
    for name, specs in (("all_float32", [cap] * n), ("mixed_with_model_dtype", [cap, {**cap, "dtype": "model"}] * (n // 2))):
        before = widened()
        got = run(specs)
        report[name] = {"blocks_widened": widened() - before,
                        "equal": [same(g, narrow[i]) for i, g in enumerate(got) if specs[i] is cap]}
        print(name, report[name]["blocks_widened"], all(report[name]["equal"]), flush=True)
    (out / "check.json").write_text(json.dumps(report, indent=1))
    ok = all(all(r["equal"]) for r in report.values()) and report["all_float32"]["blocks_widened"] > 0 \
        and report["mixed_with_model_dtype"]["blocks_widened"] == 0
    print("widen check:", "ok" if ok else "FAILED", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
