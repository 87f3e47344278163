"""Rows widened to float32 on the device are the model dtype's rows, widened (issue 17).

    source scripts/gpu_env.sh && python3 benchmarks/widen_check.py --model DIR --out $OUT/widen

An offline float32 capture whose rows all come from the prompt is converted on the device
before its copy to the host (wire "W", `delivery.collector`). One bf16 engine (CUDA graphs on a
GPU), batches of one-token requests capturing every token at 4 layers: in the model's dtype
first (after an untimed one: a process's first fetch only offers the result arena, so its rows
go by copy), then in float32, then mixing both (a block shared with a model-dtype request stays
bf16 and the frontend widens it; its model-dtype requests must get bf16). Each float32 row must
be a bf16 value, exactly (widened, nothing computed in float32), and match the first batch's
rows: bit for bit for most requests, within bf16 rounding for the rest (TOLERANCE of a block's
largest value, and under a quarter of the control: the same rows one token off). The steps are
not fixed: `LLM.generate` hands requests to the engine core's process one by one, so a batch's
first step may hold only some of them, and a bf16 row depends on its batch (runs 151 and 152:
one and two requests of 24 differed, by up to 2.9 % in run 152). Also checked: the first
batch's rows, lent from the arena and held while the later batches ran, did not change (no
range reused while lent). Writes check.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from run import bench_parser, model_and_base, tracker_layers  # noqa: E402

TOLERANCE = 0.05    # of a block's largest value, for rows of a batch with other steps


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

    def stat(key):
        return vllm_hook.stats(llm).get(key, 0)

    def compare(a, b) -> dict:
        """`a`'s rows against `b`'s: equal, or how far apart (max |a - b| over max |b|, per
        block of a site and layer), `a`'s dtype, and whether its float32 rows are bf16 values."""
        out = {"equal": True, "rel": 0.0, "bf16_values": True, "dtypes": set()}
        for s in b.activations:
            for x in b.activations[s]:
                u, v = a.activations[s][x], b.activations[s][x].float()
                out["dtypes"].add(str(u.dtype))
                out["bf16_values"] &= torch.equal(u.float(), u.bfloat16().float())
                u = u.float()
                if u.shape != v.shape:
                    out.update(equal=False, rel=float("inf"))
                elif not torch.equal(u, v):
                    out.update(equal=False, rel=max(out["rel"], float((u - v).abs().max() / v.abs().max())))
        return out

    def shifted(r):
        """`r`'s rows one token on: a row read from the wrong place, as a control."""
        return SimpleNamespace(activations={s: {x: torch.cat([t[1:], t[:1]]) for x, t in d.items()}
                                            for s, d in r.activations.items()})

    n, model_dtype = len(prompts), {**cap, "dtype": "model"}
    run([model_dtype] * n)       # the process's first fetch only offers the arena: its rows go by copy
    lent = stat("arena_pieces_lent")
    first = run([model_dtype] * n)
    kept = [SimpleNamespace(activations={s: {x: t.clone() for x, t in d.items()} for s, d in r.activations.items()})
            for r in first]
    report = {"first_batch_pieces_lent": stat("arena_pieces_lent") - lent,
              "wrong_place_rel_min": min(compare(shifted(k), k)["rel"] for k in kept)}
    for name, specs in (("all_float32", [cap] * n), ("mixed_with_model_dtype", [cap, model_dtype] * (n // 2))):
        before = stat("blocks_widened")
        got = run(specs)
        rows = [compare(g, kept[i]) for i, g in enumerate(got) if specs[i] is cap]
        narrow = [compare(g, kept[i]) for i, g in enumerate(got) if specs[i] is not cap]
        report[name] = {"blocks_widened": stat("blocks_widened") - before, "requests": len(rows),
                        "float32_and_bf16_values": all(r["dtypes"] == {"torch.float32"} and r["bf16_values"]
                                                       for r in rows),
                        "equal": sum(r["equal"] for r in rows), "max_rel_diff": max(r["rel"] for r in rows)}
        if narrow:
            report[name]["model_dtype_requests"] = {
                "requests": len(narrow), "all_bf16": all(r["dtypes"] == {"torch.bfloat16"} for r in narrow),
                "equal": sum(r["equal"] for r in narrow), "max_rel_diff": max(r["rel"] for r in narrow)}
        print(name, json.dumps(report[name]), flush=True)
    report["first_rows_changed_while_held"] = [i for i in range(n) if not compare(first[i], kept[i])["equal"]]
    again = run([model_dtype] * n)
    report["model_dtype_again"] = {"equal": sum(compare(again[i], kept[i])["equal"] for i in range(n)), "requests": n}
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, dict) or k == "model_dtype_again"}),
          flush=True)
    (out / "check.json").write_text(json.dumps(report, indent=1))
    # Rows of a batch with other steps differ by bf16 rounding carried through the layers: up
    # to 2.9 % of a block's largest value (run 152, 2 requests of 24; the others bit for bit).
    # A row read one token off is the control (`wrong_place_rel_min`): the tolerance must sit
    # well below it. Most requests must match bit for bit.
    tol = min(TOLERANCE, report["wrong_place_rel_min"] / 4)
    groups = [report["all_float32"], report["mixed_with_model_dtype"],
              report["mixed_with_model_dtype"]["model_dtype_requests"]]
    ok = report["all_float32"]["blocks_widened"] > 0 and report["first_batch_pieces_lent"] > 0 \
        and not report["first_rows_changed_while_held"] \
        and report["all_float32"]["float32_and_bf16_values"] and report["mixed_with_model_dtype"]["float32_and_bf16_values"] \
        and report["mixed_with_model_dtype"]["model_dtype_requests"]["all_bf16"] \
        and all(g["max_rel_diff"] < tol and 2 * g["equal"] >= g["requests"] for g in groups)
    print("widen check:", "ok" if ok else "FAILED", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
