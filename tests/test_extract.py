"""`vllm-hook extract` on real engines (tiny model): its rows equal `vllm_hook.results()` of
the same prompts, bad lines are reported by number, a killed run resumes to the same
dataset, memory stays flat over 5,000 prompts, and `load_dataset` reads it back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

import vllm_hook
from tests.helpers.common import PROMPTS, random_prompts as prompts, sp, write_jsonl
from tests.test_hooks import hooks_engine
from vllm_hook.extract import BadInput, Job, Manifest, OfflineEngine, extract
from vllm_hook.testing.tiny_models import tiny_model

pytestmark = pytest.mark.engine
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture
def llm(engines):
    return hooks_engine(engines)


def _reference_rows(llm, inputs: list[dict], spec: dict, layers: list[int]) -> list[dict]:
    """The same prompts through llm.generate in one call, rows taken from `results()`."""
    tok = llm.get_tokenizer()
    eng = []
    for x in inputs:
        if "prompt" in x or "prompt_token_ids" in x:
            eng.append(x)
        else:
            text = tok.apply_chat_template(x["messages"], tokenize=False, add_generation_prompt=True)
            eng.append({"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]})
    outs = llm.generate(eng, sp(spec, max_tokens=1), use_tqdm=False)
    refs = []
    for o in outs:
        r = vllm_hook.results(o)
        pos = r.positions["resid_post"][layers[0]]
        refs.append({"position": pos, "token_id": torch.tensor(r.token_ids)[pos],
                     **{L: r.activations["resid_post"][L] for L in layers}})
    return refs


def test_rows_equal_results_of_the_same_prompts(llm, tmp_path):
    inputs = ([{"prompt": p} for p in PROMPTS] + [{"messages": CHAT, "id": "chat-1"}]
              + [{"prompt_token_ids": [5, 77, 300, 12, 9]}])
    src = write_jsonl(tmp_path / "in.jsonl", inputs)
    job = Job(model="tiny", input=str(src), layers=[0, -1], tokens="all", shard_rows=40)
    m = extract(OfflineEngine(llm), job, tmp_path / "out", progress=False)
    assert m.complete and m.failures == [] and m.layers == [0, 3] and len(m.shards) > 1
    ds = vllm_hook.load_dataset(tmp_path / "out")
    refs = _reference_rows(llm, inputs, job.spec(), [0, 3])
    idx = ds["prompt_index"]
    assert sorted(set(idx.tolist())) == list(range(len(inputs)))
    for i, ref in enumerate(refs):
        rows = idx == i
        assert torch.equal(ds["position"][rows], ref["position"])
        assert torch.equal(ds["token_id"][rows], ref["token_id"])
        for L in (0, 3):        # one engine call of the same prompts in the same order: bit for bit
            assert torch.equal(ds.activations(L)[rows], ref[L]), (i, L)
    # The chat input went through the chat template, as vLLM's chat does.
    assert ds["token_id"][idx == len(PROMPTS) + 1].tolist() == [5, 77, 300, 12, 9]
    chat_ids = ds["token_id"][idx == len(PROMPTS)].tolist()
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat_ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ds["resid_post.3"].dtype == torch.float32 and len(ds) == sum(s.rows for s in m.shards)

    # bf16 storage, last prompt token only: the same rows, converted.
    job16 = Job(model="tiny", input=str(src), layers=[3], tokens="last_prompt", dtype="bfloat16")
    extract(OfflineEngine(llm), job16, tmp_path / "out16", progress=False)
    ds16 = vllm_hook.load_dataset(tmp_path / "out16")
    assert len(ds16) == len(inputs) and ds16["resid_post.3"].dtype == torch.bfloat16
    last = torch.stack([ref[3][-1] for ref in refs])
    assert (ds16["resid_post.3"].float() - last).abs().max() <= 1e-2 * last.abs().max()

    # to_hf: a datasets.Dataset with the same rows.
    hf = ds.to_hf(cache_dir=str(tmp_path / "hf_cache"))
    assert len(hf) == len(ds) and set(hf.column_names) == set(ds.columns)
    assert torch.equal(torch.tensor(hf[5]["resid_post.0"]), ds["resid_post.0"][5])


def test_bad_lines_are_reported_by_number_and_skipped(llm, tmp_path, capsys):
    good = prompts(6, seed=1)
    lines = [{"prompt": good[0]}, "{not json", {"text": "no prompt"}, {"prompt": ""},
             {"prompt": good[1]}, "", {"prompt": " ".join(["sea"] * 600)},       # too long
             {"messages": [{"role": "user"}]}, [1, 2], {"prompt": good[2]},
             {"prompt": 7}, {"prompt": good[3], "messages": CHAT}, {"prompt": good[4]}]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    job = Job(model="tiny", input=str(src), layers=[1], tokens="last_prompt")
    m = extract(OfflineEngine(llm), job, tmp_path / "out", progress=False)
    where = {f.where: f.error for f in m.failures}
    assert sorted(where, key=lambda w: int(w.split()[1])) == [
        "line 2", "line 3", "line 4", "line 7", "line 8", "line 9", "line 11", "line 12"]
    assert "not valid JSON" in where["line 2"]
    assert 'exactly one of "prompt"' in where["line 3"] and 'exactly one of "prompt"' in where["line 12"]
    assert "empty" in where["line 4"]
    assert "maximum context length" in where["line 7"]
    assert "messages.0.content" in where["line 8"] and "JSON object" in where["line 9"]
    assert "prompt" in where["line 11"]
    err = capsys.readouterr().err
    assert "line 7:" in err and "(skipped)" in err
    ds = vllm_hook.load_dataset(tmp_path / "out")
    assert ds["prompt_index"].tolist() == [0, 4, 9, 12]        # line 6 (blank) is no input
    assert m.complete and m.records_done == len(lines)

    # --on-bad-line fail: stops at line 2, with the rows before it written.
    with pytest.raises(BadInput, match="line 2: not valid JSON"):
        extract(OfflineEngine(llm), job, tmp_path / "fail", on_bad="fail", progress=False)
    m2 = Manifest.load(tmp_path / "fail")
    assert not m2.complete and m2.records_done == 1
    assert vllm_hook.load_dataset(tmp_path / "fail")["prompt_index"].tolist() == [0]
    # A prompt vLLM refuses (line 7) stops it too, after lines 1 to 6 are written.
    write_jsonl(src, [{"prompt": good[0]}, {"prompt": good[1]}, "", {"prompt": " ".join(["sea"] * 600)},
                      {"prompt": good[2]}])
    with pytest.raises(BadInput, match="line 4: .*maximum context length"):
        extract(OfflineEngine(llm), job, tmp_path / "fail2", on_bad="fail", progress=False)
    assert vllm_hook.load_dataset(tmp_path / "fail2")["prompt_index"].tolist() == [0, 1]


def test_output_dir_and_option_checks(llm, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in prompts(5)])
    job = Job(model="tiny", input=str(src), layers=[1], tokens="last_prompt")
    extract(OfflineEngine(llm), job, tmp_path / "out", progress=False)
    with pytest.raises(FileExistsError, match="--resume"):
        extract(OfflineEngine(llm), job, tmp_path / "out", progress=False)
    other = job.model_copy(update={"layers": [2]})
    with pytest.raises(ValueError, match="other options.*'layers': \\(\\[1\\], \\[2\\]\\)"):
        extract(OfflineEngine(llm), other, tmp_path / "out", resume=True, progress=False)
    # A complete dataset resumed is left as it is.
    assert extract(OfflineEngine(llm), job, tmp_path / "out", resume=True, progress=False).complete
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        extract(OfflineEngine(llm), job, tmp_path / "junk", progress=False)
    with pytest.raises(ValueError, match="do not work with this model.*layers"):
        extract(OfflineEngine(llm), Job(model="tiny", input=str(src), layers=[9]), tmp_path / "bad", progress=False)


def test_hf_dataset_directory_input_equals_jsonl(llm, tmp_path):
    import datasets

    texts = prompts(12, seed=3)
    datasets.Dataset.from_dict({"prompt": texts, "label": list(range(12))}).save_to_disk(str(tmp_path / "hf"))
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in texts])
    for name, src in (("hf", tmp_path / "hf"), ("jsonl", tmp_path / "in.jsonl")):
        extract(OfflineEngine(llm), Job(model="tiny", input=str(src), layers=[2], tokens="all"),
                tmp_path / f"out-{name}", progress=False)
    a, b = (vllm_hook.load_dataset(tmp_path / f"out-{n}") for n in ("hf", "jsonl"))
    for col in a.columns:
        assert torch.equal(a[col], b[col]), col


def _rss_during(fn) -> tuple[list[int], object]:
    """RSS samples (bytes, every 20 ms) of this process (engine included: in-process) while fn runs."""
    proc, samples, done = psutil.Process(), [], threading.Event()

    def sample():
        while not done.is_set():
            samples.append(proc.memory_info().rss)
            time.sleep(0.02)

    th = threading.Thread(target=sample)
    th.start()
    try:
        out = fn()
    finally:
        done.set()
        th.join()
    return samples, out


def test_memory_stays_flat_over_5000_prompts(llm, tmp_path):
    texts = prompts(5000, seed=5)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": t} for t in texts])
    # vLLM's own memory grows over its first thousands of prompts (CPU allocator and kernel
    # caches, with or without the plugin): shown first, plain generate on the same prompts.
    plain = lambda: [llm.generate(texts[i:i + 256], sp(None, max_tokens=1), use_tqdm=False)  # noqa: E731
                     and None for i in range(0, len(texts), 256)]
    base, _ = _rss_during(plain)
    job = Job(model="tiny", input=str(src), layers="all", tokens="all", shard_rows=20000)
    runs = [_rss_during(lambda: extract(OfflineEngine(llm), job, tmp_path / f"out{k}", progress=False))
            for k in range(2)]
    m = runs[0][1]
    written = sum((tmp_path / "out0" / s.file).stat().st_size for s in m.shards)
    grow = [max(rss) - rss[0] for rss, _ in runs]
    print(f"\n[extract memory] 5,000 prompts, {m.rows} rows, {written / 2**20:.0f} MiB written in "
          f"{len(m.shards)} shards per run; RSS growth: plain vLLM {(base[-1] - base[0]) / 2**20:.0f} "
          f"MiB, extract run 1 {grow[0] / 2**20:.0f} MiB, run 2 {grow[1] / 2**20:.0f} MiB; RSS at the "
          f"end {runs[1][0][-1] / 2**20:.0f} MiB")
    assert m.complete and written > 500 << 20
    # Once vLLM's own growth has settled, a run grows by about two shards (one being written,
    # one filling) and a batch at most, not by the dataset: a leak of rows would add what it wrote.
    assert grow[1] <= 3 * written / len(m.shards) + (64 << 20), grow


def _cli(args: list[str], env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vllm_hook.extract", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True, text=True)


def test_cli_resume_after_kill_equals_an_uninterrupted_run(engines, tmp_path):
    engines.close()         # the CLI runs its own engines; the 2 cores go to them
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in prompts(1000, seed=7)]
                      + ["{bad"] + [{"prompt": p} for p in prompts(200, seed=8)])
    common = [str(src), "--model", tiny_model("qwen2"), "--layers", "0,2", "--tokens", "all",
              "--shard-rows", "2000", "--batch-size", "32", "--enforce-eager", "--max-model-len", "512",
              "--engine-args", json.dumps({"dtype": "float32", "kv_cache_memory_bytes": 64 << 20,
                                           "max_num_seqs": 16}), "--no-progress"]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    full = _cli([*common, "--out", str(tmp_path / "full")], env)
    log = full.communicate(timeout=600)[0]
    assert full.returncode == 0, log[-3000:]
    assert "shards in" in log and "1 failed" in log

    killed_dir = tmp_path / "killed"
    p = _cli([*common, "--out", str(killed_dir)], env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if len(Manifest.load(killed_dir).shards) >= 2:
                break
        except (FileNotFoundError, ValueError):
            pass
        assert p.poll() is None, p.communicate()[0][-3000:]
        time.sleep(0.02)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    before = Manifest.load(killed_dir)
    assert not before.complete and before.records_done < 1201, "the run finished before the kill"

    again = _cli([*common, "--out", str(killed_dir), "--resume"], env)
    log = again.communicate(timeout=600)[0]
    assert again.returncode == 0, log[-3000:]
    a, b = Manifest.load(tmp_path / "full"), Manifest.load(killed_dir)
    assert b.complete and a.shards == b.shards and a.failures == b.failures
    assert [f.where for f in b.failures] == ["line 1001"]
    assert a.tokens_processed == b.tokens_processed
    da, db = vllm_hook.load_dataset(tmp_path / "full"), vllm_hook.load_dataset(killed_dir)
    for col in ("prompt_index", "position", "token_id"):
        assert torch.equal(da[col], db[col]), col
    for col in ("resid_post.0", "resid_post.2"):
        # The same rows; the resumed run batched them differently, which may move CPU float sums.
        ref = da[col]
        assert (db[col] - ref).abs().max() <= 1e-5 * ref.abs().max(), col
