"""The extraction loop: input records in batches through an engine, rows into shards."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..results import Results
from .engines import Outcome
from .inputs import Record, Source
from .job import MANIFEST, Failure, Job, Manifest
from .shards import ShardWriter, discard_unlisted

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class BadInput(RuntimeError):
    """An input failed and the job was told to stop (`on_bad="fail"`)."""


def rows_of(r: Results, record: int, job: Job, layers: list[int]) -> dict[str, torch.Tensor]:
    """One record's rows: index columns, then `{site}.{layer}` for each layer."""
    acts, positions = r.activations.get(job.site, {}), r.positions.get(job.site, {})
    if sorted(acts) != layers:
        raise RuntimeError(f"record {record}: captured layers {sorted(acts)}, expected {layers}")
    pos = positions[layers[0]]
    for L in layers[1:]:
        if not torch.equal(positions[L], pos):
            raise RuntimeError(f"record {record}: layers {layers[0]} and {L} captured different tokens")
    rows = {"prompt_index": torch.full((len(pos),), record, dtype=torch.int64), "position": pos,
            "token_id": torch.tensor(r.token_ids, dtype=torch.int64)[pos]}
    to = TORCH_DTYPES.get(job.dtype)
    for L in layers:
        rows[f"{job.site}.{L}"] = acts[L].to(to) if to is not None else acts[L]
    return rows


def _open(out: Path, job: Job, resume: bool) -> Manifest:
    if (out / MANIFEST).exists():
        if not resume:
            raise FileExistsError(f"{out} already holds a dataset: pass --resume to continue it, "
                                  "or choose another --out")
        manifest = Manifest.load(out)
        if manifest.job != job:
            mine, theirs = job.model_dump(), manifest.job.model_dump()
            diff = {k: (theirs[k], mine[k]) for k in mine if mine[k] != theirs[k]}
            raise ValueError(f"{out} was written with other options ({{option: (then, now)}}: "
                             f"{diff}); resume with the same options, or choose another --out")
        discard_unlisted(out, manifest)
        return manifest
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty and holds no {MANIFEST}: choose an empty or new --out")
    out.mkdir(parents=True, exist_ok=True)
    return Manifest(job=job)


def extract(engine, job: Job, out_dir: str | Path, *, resume: bool = False, on_bad: str = "skip",
            batch_size: int = 256, progress: bool = True) -> Manifest:
    """Run `job` on `engine` (`OfflineEngine` / `ServedEngine`) into `out_dir`; returns the
    manifest. `on_bad`: "skip" records a failed input and goes on; "fail" stops at it,
    after writing every row before it."""
    out = Path(out_dir)
    source = Source(job.input, job.split)
    spec = job.spec()
    manifest = _open(out, job, resume)
    if manifest.complete:
        return manifest
    # One request first: options the model cannot serve (a layer it lacks) fail here, once.
    probe = engine.run([Record(-1, "probe", token_ids=list(range(1, 9)))], spec, 1)[0]
    if isinstance(probe, str):
        raise ValueError(f"the capture/steering options do not work with this model: {probe}")
    manifest.records_total = len(source)
    writer = ShardWriter(out, manifest)
    layers = manifest.layers or sorted(probe.activations.get(job.site, {}))
    manifest.layers = layers
    bar = tqdm(total=manifest.records_total, initial=manifest.records_done, unit="prompt",
               disable=not progress, dynamic_ncols=True)
    t0, tokens = time.monotonic(), 0

    def failed(rec: Record, error: str) -> None:
        if on_bad == "fail":
            writer.stop(records_done=rec.index)
            raise BadInput(f"{rec.label}: {error}. The rows before it are written; fix the input "
                           "and rerun with --resume, or pass --on-bad-line skip")
        tqdm.write(f"[vllm-hook extract] {rec.label}: {error} (skipped)", file=sys.stderr)
        writer.fail(Failure(record=rec.index, where=rec.label, error=error))

    def run(batch: list[Record]) -> None:
        nonlocal tokens
        outcomes: list[Outcome] = engine.run(batch, spec, job.max_tokens) if batch else []
        for rec, o in zip(batch, outcomes):
            if isinstance(o, str) or o.errors:
                failed(rec, o if isinstance(o, str) else "; ".join(o.errors))
                continue
            writer.add(rec.index, rows_of(o, rec.index, job, layers), len(o.token_ids))
            tokens += len(o.token_ids)
        if batch:
            bar.update(max(0, batch[-1].index + 1 - bar.n))
        bar.set_postfix_str(f"{tokens / max(time.monotonic() - t0, 1e-9):,.0f} tok/s", refresh=False)

    batch: list[Record] = []
    try:
        for rec in source.records(manifest.records_done):
            if rec.error is not None:
                if on_bad == "fail":
                    run(batch)
                    batch = []
                failed(rec, rec.error)
                bar.update(max(0, rec.index + 1 - bar.n))
                continue
            batch.append(rec)
            if len(batch) >= batch_size:
                run(batch)
                batch = []
        run(batch)
    except BadInput:
        bar.close()
        raise
    except BaseException:
        bar.close()
        writer.stop()       # finish the shard being written; the rest is redone on --resume
        raise
    writer.finish(manifest.records_total)
    bar.close()
    return manifest
