"""`vllm-hook extract`: build an activation dataset from a JSONL file or a saved HF dataset.

    vllm-hook extract prompts.jsonl --model Qwen/Qwen2-1.5B --layers 4,12,-1 \\
        --tokens last_prompt --dtype bfloat16 --out acts/
    vllm-hook extract prompts.jsonl --server http://localhost:8000 --layers all --out acts/

Each input line is {"prompt": "..."} or {"messages": [{"role": ..., "content": ...}, ...]}.
The output directory gets safetensors shards (one row per token: prompt_index, position,
token_id, {site}.{layer}) and manifest.json; read it with `vllm_hook.load_dataset(DIR)`.
"""

from __future__ import annotations

import argparse
import json
import sys

from .job import DTYPES, EXTRACT_SITES, Job, steer_from_file

SELECTORS = ("all", "prompt", "generated", "last_prompt", "last")


def _layers(v: str):
    if v == "all":
        return "all"
    try:
        return [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers: 'all' or comma-separated integers, got {v!r}") from None


def _tokens(v: str):
    if v in SELECTORS:
        return v
    try:
        return [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens: one of {', '.join(SELECTORS)} or comma-separated "
                                         f"positions, got {v!r}") from None


def _json_object(v: str) -> dict:
    try:
        obj = json.loads(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return obj


def parser(prog: str = "vllm-hook extract") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", help="JSONL file, or a directory written by datasets' save_to_disk")
    ap.add_argument("--out", required=True, help="output directory (new or empty, or one to --resume)")
    ap.add_argument("--model", help="model path or name (offline); with --server, the served model "
                    "(default: the server's first)")
    ap.add_argument("--layers", type=_layers, default="all", help="'all' or e.g. 0,12,-1 (default all)")
    ap.add_argument("--site", choices=EXTRACT_SITES, default="resid_post")
    ap.add_argument("--tokens", type=_tokens, default="all",
                    help=f"{', '.join(SELECTORS)} or positions like 0,-1 (default all)")
    ap.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="stored dtype; 'model' keeps the model's (default float32)")
    ap.add_argument("--max-tokens", type=int, default=1,
                    help="tokens to generate per prompt (default 1: prompt activations only)")
    ap.add_argument("--spec", help="JSON file of steering ops applied while extracting")
    ap.add_argument("--shard-rows", type=int, default=65536, help="rows per shard file (default 65536)")
    ap.add_argument("--batch-size", type=int, default=256, help="prompts per engine batch (default 256)")
    ap.add_argument("--split", help="split of a DatasetDict directory")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    ap.add_argument("--on-bad-line", choices=("skip", "fail"), default="skip",
                    help="a bad input: record it and go on (default), or stop there")
    ap.add_argument("--no-progress", action="store_true")
    served = ap.add_argument_group("served (--server)")
    served.add_argument("--server", help="URL of a `vllm serve` with vllm-hook: send the job there")
    served.add_argument("--api-key")
    served.add_argument("--concurrency", type=int, default=64, help="requests in flight (default 64)")
    offline = ap.add_argument_group("offline engine")
    offline.add_argument("--max-model-len", type=int)
    offline.add_argument("--enforce-eager", action="store_true")
    offline.add_argument("--engine-args", type=_json_object, default={},
                         help='more vllm.LLM arguments as JSON, e.g. \'{"tensor_parallel_size": 2}\'')
    offline.add_argument("--hook-config", type=_json_object, default={},
                         help="vllm_hook engine config (docs/config.md) merged over what the job needs")
    return ap


def hook_config(job: Job, extra: dict) -> dict:
    """The engine config a job needs: its site instrumented, projection layers for its ops."""
    proj = sorted({op["layer"] for op in job.steer or []
                   if op.get("op") in ("cap", "ablate") or op.get("norm_match")})
    cfg = {"sites": sorted({"resid_post", "resid_pre", job.site})}
    if proj:
        cfg["projection_layers"] = proj
    return {**cfg, **extra}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from .engines import OfflineEngine, ServedEngine
    from .run import BadInput, extract

    if args.server is None and args.model is None:
        parser().error("give --model (offline) or --server URL")
    try:
        steer = steer_from_file(args.spec)
        engine = (ServedEngine(args.server, api_key=args.api_key, model=args.model,
                               concurrency=args.concurrency) if args.server else None)
        job = Job(model=engine.model if engine else args.model, input=args.input, split=args.split,
                  site=args.site, layers=args.layers, tokens=args.tokens, dtype=args.dtype,
                  max_tokens=args.max_tokens, steer=steer, shard_rows=args.shard_rows)
        job.spec()
        if engine is None:
            from vllm import LLM

            kw = {"max_model_len": args.max_model_len} if args.max_model_len else {}
            llm = LLM(args.model, enforce_eager=args.enforce_eager, **kw, **args.engine_args,
                      additional_config={"vllm_hook": hook_config(job, args.hook_config)})
            engine = OfflineEngine(llm)
        try:
            m = extract(engine, job, args.out, resume=args.resume, on_bad=args.on_bad_line,
                        batch_size=args.batch_size, progress=not args.no_progress)
        finally:
            engine.close()
    except BadInput as e:
        print(f"vllm-hook extract: stopped: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileExistsError, FileNotFoundError, RuntimeError) as e:
        print(f"vllm-hook extract: error: {e}", file=sys.stderr)
        return 2
    print(f"vllm-hook extract: {m.rows} rows in {len(m.shards)} shards in {args.out} "
          f"({m.records_total} inputs, {len(m.failures)} failed: see manifest.json)", file=sys.stderr)
    return 0
