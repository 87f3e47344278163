"""Can the device write a request's captured rows straight into its final place in host memory?

    source scripts/gpu_env.sh && python3 benchmarks/uva_probe.py --out $OUT/uva

A probe for a delivery design, not the plugin's code (issue 17: the mixed batch at 256 x 128 +
128 spends about 85 µs a hooked request (run 149) in the frontend joining each every-token
capture's prompt rows and decode rows into one tensor, a host copy at memory bandwidth). Today
a step's rows go by one contiguous device-to-host copy into a page-locked block ([rows,
width]: the arena, or pinned memory) and are joined per request on the host at the end. The
alternative: the host block is page-locked (as the worker's arena is, `cudaHostRegister`), so
under unified addressing a kernel can scatter each step's rows over the bus straight into
each request's region [points, tokens, width], widened to float32 on the way if asked; the
frontend would then view that region in place, with no join.

Times, on the device (CUDA events, median of `--reps`), for the mixed batch's every-token third
(85 requests, 4 points, 1,536 wide, bf16, 128 prompt + 128 decode rows each; a request of 128
generated tokens forwards 127):
- the prompt step: one contiguous copy to pinned memory, against a scatter into the regions
  (bf16 and widened to float32);
- a decode step, likewise (85 x 4 rows);
- on the host: the join of prompt and decode rows per request that the scatter would remove
  (torch's threads), bf16 -> float32 as the frontend does it.
Checks that the scattered regions equal the rows they came from. Writes uva.json.
`--smoke`: the same on the CPU (the "device" is host memory) with small shapes (6 requests, 64
wide), for CI. Exits 1 if a region differs from its rows.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REQ, POINTS, WIDTH, PROMPT, DECODE = 85, 4, 1536, 128, 128


class _Host:
    """A page-locked anonymous shared mapping, as the worker's arena (`delivery.arena`)."""

    def __init__(self, nbytes: int, cuda: bool):
        self.fd = os.memfd_create("vh-uva-probe")
        os.ftruncate(self.fd, nbytes)
        self.map = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes)
        self.ptr = self.tensor.data_ptr()
        self.dev_ptr = self.ptr
        if cuda:
            err = int(torch.cuda.cudart().cudaHostRegister(self.ptr, nbytes, 0))
            if err:
                raise OSError(f"cudaHostRegister failed ({err})")
            self.dev_ptr = _device_pointer(self.ptr)

    def device_view(self, dtype: torch.dtype, cuda: bool) -> torch.Tensor:
        """The same bytes as a tensor the device writes (its own address for them)."""
        n = self.tensor.numel()
        if not cuda:
            return self.tensor.view(dtype)

        class _Iface:     # torch.as_tensor reads __cuda_array_interface__
            __cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (self.dev_ptr, False),
                                        "version": 3}
            host = self   # the mapping lives as long as the tensor made from this object
        return torch.as_tensor(_Iface(), device="cuda").view(dtype)


def _device_pointer(ptr: int) -> int:
    """cudaHostGetDevicePointer through the libcudart this process loaded (equal to `ptr`
    where the device can use host pointers for registered memory)."""
    with open("/proc/self/maps") as f:
        lib = next((line.split()[-1] for line in f if "libcudart" in line), None)
    if lib is None:
        return ptr
    out = ctypes.c_void_p()
    err = ctypes.CDLL(lib).cudaHostGetDevicePointer(ctypes.byref(out), ctypes.c_void_p(ptr), 0)
    return int(out.value) if err == 0 and out.value else ptr


def _timed(fn, reps: int, cuda: bool) -> float:
    """Median µs of fn() on the device (events) or the host."""
    times = []
    for _ in range(reps + 1):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(1e3 * a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e6 * (time.perf_counter() - t))
    return round(statistics.median(times[1:]), 1)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU, small shapes")
    args = ap.parse_args()
    cuda = not args.smoke and torch.cuda.is_available()
    req, width = (6, 64) if args.smoke else (REQ, WIDTH)
    dev = torch.device("cuda" if cuda else "cpu")
    T = PROMPT + DECODE
    g = torch.Generator(device=dev).manual_seed(0)
    # The step's pool rows as the capture scatter leaves them: prompt rows [points, req * PROMPT,
    # width] (a request's rows together per point), a decode step's [points, req, width].
    prompt_rows = torch.randn((POINTS, req * PROMPT, width), generator=g, device=dev).bfloat16()
    decode_rows = torch.randn((DECODE, POINTS, req, width), generator=g, device=dev).bfloat16()
    # Flat destination rows in regions [req, points, T, width]: row (r, p, t) -> (r * POINTS + p) * T + t.
    r = torch.arange(req, device=dev)
    p = torch.arange(POINTS, device=dev)
    base = (r[None, :] * POINTS + p[:, None]) * T                          # [points, req]
    prompt_idx = (base[:, :, None] + torch.arange(PROMPT, device=dev)).reshape(-1)
    decode_idx = [(base + PROMPT + s).reshape(-1) for s in range(DECODE)]
    rows = req * POINTS * T
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "requests": req, "points": POINTS,
           "width": width, "prompt": PROMPT, "decode": DECODE}
    hosts = {dt: _Host(rows * width * dt.itemsize, cuda) for dt in (torch.bfloat16, torch.float32)}
    views = {dt: h.device_view(dt, cuda).view(rows, width) for dt, h in hosts.items()}
    pinned_prompt = torch.empty(prompt_rows.shape, dtype=torch.bfloat16, pin_memory=cuda)
    pinned_step = torch.empty(decode_rows.shape[1:], dtype=torch.bfloat16, pin_memory=cuda)
    flat_prompt = prompt_rows.reshape(-1, width)

    def scatter_step(dt: torch.dtype, s: int):
        src = decode_rows[s].reshape(-1, width)
        views[dt].index_copy_(0, decode_idx[s], src if dt == torch.bfloat16 else src.float())

    def scatter_prompt(dt: torch.dtype):
        views[dt].index_copy_(0, prompt_idx, flat_prompt if dt == torch.bfloat16 else flat_prompt.float())

    out["device_us"] = {
        "prompt_step_copy_to_pinned": _timed(lambda: pinned_prompt.copy_(prompt_rows, non_blocking=True), args.reps, cuda),
        "prompt_step_scatter_bf16": _timed(lambda: scatter_prompt(torch.bfloat16), args.reps, cuda),
        "prompt_step_scatter_float32": _timed(lambda: scatter_prompt(torch.float32), args.reps, cuda),
        "decode_step_copy_to_pinned": _timed(lambda: pinned_step.copy_(decode_rows[0], non_blocking=True), args.reps, cuda),
        "decode_step_scatter_bf16": _timed(lambda: scatter_step(torch.bfloat16, 0), args.reps, cuda),
        "decode_step_scatter_float32": _timed(lambda: scatter_step(torch.float32, 0), args.reps, cuda),
    }
    # Every step once, then the regions against the rows they came from.
    for dt in views:
        scatter_prompt(dt)
        for s in range(DECODE):
            scatter_step(dt, s)
    if cuda:
        torch.cuda.synchronize()
    want = torch.cat([prompt_rows.reshape(POINTS, req, PROMPT, width),
                      decode_rows.permute(1, 2, 0, 3)], dim=2).transpose(0, 1).cpu()   # [req, points, T, width]
    out["regions_equal"] = {str(dt): bool(torch.equal(h.tensor.view(dt).view(want.shape), want.to(dt)))
                            for dt, h in hosts.items()}
    # The host join the scatter would remove: per request, its prompt rows and its decode rows
    # (a view across the run's steps) into one float32 tensor, as the frontend's parse does.
    host_prompt = prompt_rows.cpu().reshape(POINTS, req, PROMPT, width)
    host_run = decode_rows.cpu()                                         # [steps, points, req, width]
    dst = torch.empty((req, POINTS, T, width), dtype=torch.float32)

    def join():
        for i in range(req):
            dst[i, :, :PROMPT].copy_(host_prompt[:, i])
            dst[i, :, PROMPT:].copy_(host_run[:, :, i].transpose(0, 1))

    out["host_join_float32_us_per_request"] = round(_timed(join, max(3, args.reps // 4), False) / req, 1)
    out["torch_threads"] = torch.get_num_threads()
    print(json.dumps(out, indent=1), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "uva.json").write_text(json.dumps(out, indent=1))
    sys.exit(0 if all(out["regions_equal"].values()) else 1)


if __name__ == "__main__":
    main()
