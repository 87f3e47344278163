"""A served capture result's encoding steps, timed on this host (issue 17).

    python benchmarks/served_encoding.py [--layers 4] [--rows 1] [--hidden 1536] [--out FILE]

One `Results` like a last-prompt capture of 4 layers of the Qwen2-1.5B shape (bf16 rows sent
in the model's dtype, 256 token ids; its layers' rows lying as a fetch of 256 requests packs
them, one block per layer group), encoded as the API server encodes it, each step timed alone
(median of 7 runs of 2,000 calls, µs a call): `Results._payload`, `st_bytes`, the whole entry
(`encode_one`) per layer and with stacked sites (`*_stacked`), and the response's JSON rendered
by starlette's `JSONResponse` against the plugin's (`adapters.server`: the field by msgspec).
Why: the API server's per-request figures on the lent GPU hosts differ from the CI machine's
by more than their host probes do (run 134). Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import timeit
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]

import torch  # noqa: E402

from run import host_probe  # noqa: E402


def timed(fn, number: int = 2000, repeat: int = 7) -> float:
    return round(statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--out")
    args = ap.parse_args()

    import safetensors
    from starlette.responses import JSONResponse

    from vllm_hook.adapters.server import _rendering
    from vllm_hook.config import HookConfig
    from vllm_hook.delivery import store
    from vllm_hook.results import Results
    from vllm_hook.server import encode
    from vllm_hook.server.store import ResultStore

    layers = [3 + 6 * i for i in range(args.layers)]
    packed = torch.randn(args.layers, 256 * args.rows, args.hidden).to(torch.bfloat16)    # a fetch's rows
    j = 5 * args.rows
    pos = torch.arange(128 - args.rows, 128)
    r = Results(request_id="cmpl-0123456789abcdef-0", prompt_len=128, token_ids=list(range(256)), model="m",
                activations={"resid_post": {L: packed[i, j:j + args.rows] for i, L in enumerate(layers)}},
                positions={"resid_post": {L: pos for L in layers}}, widen_to="float32")
    cfg = HookConfig()
    kept = ResultStore(cfg.max_retained_bytes, 60)
    tensors, meta = r._payload()
    stacked = r._payload(True)
    body = {"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 128, "completion_tokens": 128, "total_tokens": 256},
            "vllm_hook": {"results": [encode.encode_one(r, 0, kept, cfg)]}}     # what `payload` makes of it
    ours = _rendering(JSONResponse)
    out = {
        "host": host_probe(), "python": platform.python_version(), "safetensors": safetensors.__version__,
        "torch": torch.__version__, "layers": args.layers, "result_bytes": len(r.to_bytes()),
        "us": {
            "payload": timed(r._payload),
            "payload_stacked": timed(lambda: r._payload(True)),
            "st_bytes": timed(lambda: store.st_bytes(tensors, meta)),
            "st_bytes_stacked": timed(lambda: store.st_bytes(*stacked)),
            "encode_one": timed(lambda: encode.encode_one(r, 0, kept, cfg)),
            "encode_one_stacked": timed(lambda: encode.encode_one(r, 0, kept, cfg, stacked=True)),
            "render_starlette": timed(lambda: JSONResponse(content=body)),
            "render_plugin": timed(lambda: ours(content=body)),
        },
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)



if __name__ == "__main__":
    main()
