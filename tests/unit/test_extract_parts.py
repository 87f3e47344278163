"""The parts of `vllm-hook extract` that need no engine: input records, shard boundaries and
resume, the job's spec, the command line."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.common import write_jsonl
from vllm_hook.extract.cli import hook_config, parser
from vllm_hook.extract.dataset import load_dataset
from vllm_hook.extract.inputs import Source
from vllm_hook.extract.job import Failure, Job, Manifest, steer_from_file
from vllm_hook.extract.shards import ShardWriter, discard_unlisted


def test_records_are_checked_one_by_one(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"prompt": "a b"}, "", "{oops", {"prompt": ""}, {"messages": []}, {"prompt_token_ids": [1, True]},
        {"messages": [{"role": "user", "content": "hi"}], "id": 4}, {"prompt_token_ids": [3, 4]},
        "[" * 100000 + "]" * 100000])
    recs = list(Source(src).records())
    assert [r.label for r in recs] == [f"line {i}" for i in (1, 3, 4, 5, 6, 7, 8, 9)]
    ok = {r.label: r for r in recs if r.error is None}
    assert set(ok) == {"line 1", "line 7", "line 8"}
    assert ok["line 7"].messages == [{"role": "user", "content": "hi"}] and ok["line 8"].token_ids == [3, 4]
    errors = {r.label: r.error for r in recs if r.error}
    assert "not valid JSON" in errors["line 3"] and "empty" in errors["line 4"]
    assert "empty" in errors["line 5"] and "prompt_token_ids.1" in errors["line 6"]
    assert "not valid JSON" in errors["line 9"] or "JSON object" in errors["line 9"]
    assert len(Source(src)) == 9
    assert [r.index for r in Source(src).records(start=6)] == [6, 7, 8]


def test_dataset_directory_needs_a_prompt_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["a"]}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(ValueError, match="'prompt', 'messages' or 'prompt_token_ids' column"):
        Source(tmp_path / "d")
    datasets.DatasetDict({"a": datasets.Dataset.from_dict({"prompt": ["x"]}),
                          "b": datasets.Dataset.from_dict({"prompt": ["y", "z"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match="pass --split"):
        Source(tmp_path / "dd")
    assert [r.prompt for r in Source(tmp_path / "dd", "b").records(1)] == ["z"]


def _rows(record: int, n: int) -> dict:
    return {"prompt_index": torch.full((n,), record), "position": torch.arange(n),
            "token_id": torch.arange(n) + 100, "resid_post.0": torch.randn(n, 4)}


def _write(tmp_path, name, lengths, start=0, manifest=None, shard_rows=10):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    m = manifest or Manifest(job=Job(model="m", input="i", layers=[0], shard_rows=shard_rows))
    w = ShardWriter(out, m)
    for i in range(start, len(lengths)):
        if lengths[i] is None:
            w.fail(Failure(record=i, where=f"line {i + 1}", error="bad"))
        else:
            w.add(i, _rows(i, lengths[i]), lengths[i] + 1)
    w.finish(len(lengths))
    return out, m


def test_shards_close_between_records_and_resume_gives_the_same_shards(tmp_path):
    lengths = [4, 3, 5, None, 9, 1, 1, 12, 2, None, 3]
    out, m = _write(tmp_path, "full", lengths)
    assert [s.rows for s in m.shards] == [12, 10, 13, 5] and [s.records for s in m.shards] == [
        (0, 3), (3, 6), (6, 8), (8, 11)]
    assert [f.record for f in m.failures] == [3, 9] and m.complete and m.records_done == 11
    assert m.tokens_processed == sum(x + 1 for x in lengths if x is not None)
    assert m.columns["resid_post.0"] == ["float32", [4]]
    ds = load_dataset(out)
    assert len(ds) == 40 and ds["prompt_index"].unique().tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 10]

    # A run killed after its second shard: the manifest lists two shards; a stray file is redone.
    part = Manifest.model_validate_json((out / "manifest.json").read_text())
    part.shards, part.records_done, part.complete = part.shards[:2], 6, False
    part.failures = [f for f in part.failures if f.record < 6]
    part.tokens_processed = sum(x + 1 for x in lengths[:6] if x is not None)
    killed = tmp_path / "killed"
    killed.mkdir()
    for s in part.shards:
        (killed / s.file).write_bytes((out / s.file).read_bytes())
    (killed / "shard-00002.safetensors.tmp").write_bytes(b"half")
    (killed / "shard-00002.safetensors").write_bytes(b"unlisted")
    part.save(killed)
    discard_unlisted(killed, part)
    assert sorted(p.name for p in killed.iterdir()) == ["manifest.json", "shard-00000.safetensors",
                                                         "shard-00001.safetensors"]
    _, resumed = _write(tmp_path, "killed", lengths, start=6, manifest=Manifest.load(killed))
    assert resumed.shards == m.shards and resumed.failures == m.failures
    assert resumed.tokens_processed == m.tokens_processed


def test_job_spec_and_steering_file(tmp_path):
    job = Job(model="m", input="i", layers=[0, -1], tokens="last_prompt", dtype="bfloat16")
    assert job.spec() == {"capture": [{"layers": [0, -1], "site": "resid_post", "tokens": "last_prompt"}],
                          "dtype": "model"}
    f = tmp_path / "steer.json"
    f.write_text(json.dumps({"steer": [{"op": "ablate", "layer": 2, "vector": "v"}]}))
    ops = steer_from_file(str(f))
    assert hook_config(Job(model="m", input="i", steer=ops), {"max_vectors": 8}) == {
        "sites": ["resid_post", "resid_pre"], "projection_layers": [2], "max_vectors": 8}
    f.write_text(json.dumps({"steer": [], "capture": []}))
    with pytest.raises(ValueError, match="capture comes from --layers"):
        steer_from_file(str(f))
    f.write_text(json.dumps([{"op": "add", "layer": "x", "vector": "v"}]))
    with pytest.raises(ValueError):
        steer_from_file(str(f))


def test_command_line_options():
    a = parser().parse_args(["in.jsonl", "--out", "o", "--layers", "0,-1", "--tokens", "0,5"])
    assert a.layers == [0, -1] and a.tokens == [0, 5] and a.site == "resid_post" and a.on_bad_line == "skip"
    assert parser().parse_args(["x", "--out", "o", "--tokens", "last"]).tokens == "last"
    for bad in (["--layers", "one"], ["--tokens", "middle"], ["--engine-args", "[1]"], ["--site", "attn_scores"]):
        with pytest.raises(SystemExit):
            parser().parse_args(["x", "--out", "o", *bad])
