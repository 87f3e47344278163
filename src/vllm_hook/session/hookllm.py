"""`HookLLM`: the vLLM-Hook / MIA wrapper's API over vllm-hook's per-request specs.

    llm = HookLLM(model, worker_name="probe_hook_qk", analyzer_name="attn_tracker",
                  config_file="model_configs/attention_tracker/Qwen2-1.5B-Instruct.json")
    out = llm.generate(text, temperature=0.1, max_tokens=50, save_to_disk=True)
    llm.analyze(analyzer_spec={"input_range": ((3, 12), (-20, -5))})["score"]

The worker names choose what each request captures or steers (one spec per request, built
from the config file), not a worker class: requests of one engine may mix them, and
`use_hook=False` runs a request plainly. Runs saved to disk are folders
`<hook_dir>/<run_id>/` holding one `Results` file per prompt (`00000.safetensors`, ...) and
`run.json`; a run id is never reused, so two runs into one folder keep both.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch

from ..analyzers import get as get_analyzer
from ..results import Results, results as results_of
from ..spec.schema import SPEC_KEY

WORKERS = ("probe_hook_qk", "probe_hook_hs", "steer_hook_act")
# vLLM-Hook's analyzer names -> ours (ours are accepted as they are).
ANALYZERS = {"attn_tracker": "attention_tracker", "core_reranker": "core_reranker",
             "hidden_states": "hidden_states"}
MODES = {"last_token": "last_prompt", "all_tokens": "prompt"}


class HookLLM:
    """`vllm.LLM` plus one worker's spec and one analyzer, vLLM-Hook style. Keyword
    arguments other than the ones below go to `vllm.LLM` (`enable_hook` and `backend`, which
    vLLM-Hook takes, are accepted and ignored: hooks are per request here, graphs stay on)."""

    def __init__(self, model: str, worker_name: str | None = None, analyzer_name: str | None = None,
                 config_file: str | os.PathLike | None = None, *, hook_dir: str | os.PathLike | None = None,
                 llm: Any = None, **llm_kwargs: Any):
        if worker_name is not None and worker_name not in WORKERS:
            raise ValueError(f"unknown worker_name {worker_name!r}; one of {list(WORKERS)} "
                             "(docs/session.md maps them to vllm-hook specs)")
        for k in ("enable_hook", "backend"):
            llm_kwargs.pop(k, None)
        self.worker_name = worker_name
        self.config_path = Path(config_file) if config_file is not None else None
        self.config = _read_config(self.config_path) if self.config_path else {}
        self.hook_dir = Path(hook_dir or os.path.expanduser("~/.cache/vllm_hook/runs"))
        if llm is None:
            from vllm import LLM

            if worker_name == "probe_hook_qk":   # attention scores read the queries: instrument q
                extra = dict(llm_kwargs.get("additional_config") or {})
                cfg = dict(extra.get("vllm_hook") or {})
                sites = list(cfg.get("sites") or ("resid_post", "resid_pre"))
                cfg["sites"] = sites + ["q"] if "q" not in sites else sites
                llm_kwargs["additional_config"] = {**extra, "vllm_hook": cfg}
            llm = LLM(model, **llm_kwargs)
        self.llm = llm
        self.tokenizer = llm.get_tokenizer()
        self.analyzer_name = analyzer_name
        self.analyzer = _analyzer(analyzer_name, self.config) if analyzer_name else None
        self.spec = self._worker_spec()
        self.last_run_id: str | None = None
        self._last: list[Results] | None = None

    def __getattr__(self, name: str) -> Any:       # llm_engine, get_tokenizer, ... of the LLM
        if name == "llm":
            raise AttributeError(name)
        return getattr(self.llm, name)

    # ---- the worker's spec -------------------------------------------------------------
    def _worker_spec(self) -> dict | None:
        w, c = self.worker_name, self.config
        if w is None:
            return None
        if w == "probe_hook_qk":
            heads = (c.get("params") or {}).get("important_heads")
            if not heads:
                raise ValueError(f"{self.config_path}: probe_hook_qk needs params.important_heads "
                                 "([[layer, head], ...])")
            by_layer: dict[int, list[int]] = {}
            for L, h in heads:
                by_layer.setdefault(int(L), []).append(int(h))
            mode = (c.get("hookq") or {}).get("hookq_mode", "last_token")
            return {"capture": [{"site": "attn_scores", "layers": sorted(by_layer),
                                 "heads": {str(L): sorted(set(hs)) for L, hs in by_layer.items()},
                                 "tokens": _mode(mode, self.config_path)}]}
        if w == "probe_hook_hs":
            hs = c.get("hidden_states") or {}
            if not hs.get("layers"):
                raise ValueError(f"{self.config_path}: probe_hook_hs needs hidden_states.layers")
            return {"capture": [{"layers": [int(x) for x in hs["layers"]],
                                 "tokens": _mode(hs.get("mode", "last_token"), self.config_path)}]}
        st = c.get("steering") or {}
        if "optimal_layer" not in st or "vector_path" not in st:
            raise ValueError(f"{self.config_path}: steer_hook_act needs steering.optimal_layer and "
                             "steering.vector_path")
        layer = int(st["optimal_layer"])
        vec = _load_vector(self._path(st["vector_path"]), layer)
        tokens = "all" if st.get("apply_at_all_positions", True) else "last"
        method = st.get("method", "add_vector")
        if method in ("add_vector", "add"):
            op = {"op": "add", "layer": layer, "vector": vec, "scale": float(st.get("coefficient", 1.0)),
                  "tokens": tokens}
        elif method == "adjust_rs":
            if "target" not in st:
                raise ValueError(f"{self.config_path}: adjust_rs sets the stream's projection on the "
                                 "vector to steering.target; add it (a float)")
            t = float(st["target"])
            op = {"op": "cap", "layer": layer, "vector": vec, "min": t, "max": t, "tokens": tokens}
        else:
            raise ValueError(f"{self.config_path}: steering.method {method!r}: use add_vector or adjust_rs")
        return {"steer": [op]}

    def _path(self, p: str) -> Path:
        """A config's relative path: beside the config file, else from the working directory."""
        q = Path(p)
        if not q.is_absolute() and self.config_path is not None and (self.config_path.parent / q).exists():
            return self.config_path.parent / q
        return q

    # ---- generate ------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[Any], sampling_params: Any = None, *, use_hook: bool = True,
                 save_to_disk: bool = False, run_id: str | None = None, spec: dict | None = None,
                 **sampling: Any) -> list:
        """vLLM's `generate` with the worker's spec on every request (`spec` adds items of
        ours). `save_to_disk` writes the run folder; either way `analyze()` reads this run."""
        from vllm import SamplingParams

        one = isinstance(prompts, (str, dict))
        batch = [prompts] if one else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams(**sampling)
        elif sampling:
            raise ValueError("pass sampling_params or sampling keywords, not both")
        full = _merge(self.spec, spec) if use_hook else None
        params = []
        for i in range(len(batch)):
            sp = (sampling_params[i] if isinstance(sampling_params, (list, tuple)) else sampling_params).clone()
            if full:
                sp.extra_args = {**(sp.extra_args or {}), SPEC_KEY: full}
            params.append(sp)
        outs = self.llm.generate(batch, params, use_tqdm=False)
        if not full:
            return outs
        res = [results_of(o) for o in outs]
        self._last = res
        if save_to_disk:
            self.last_run_id = self._save(res, run_id)
        else:
            self.last_run_id = None
        return outs

    def _save(self, res: list[Results], run_id: str | None) -> str:
        run_id = run_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]
        if "/" in run_id or run_id in ("", ".", ".."):
            raise ValueError(f"run_id {run_id!r} must be a plain folder name")
        folder = self.hook_dir / run_id
        try:
            folder.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            raise ValueError(f"run folder {folder} exists: pass another run_id (runs are never "
                             "overwritten)") from None
        for i, r in enumerate(res):
            r.save(folder / f"{i:05d}.safetensors")
        (folder / "run.json").write_text(json.dumps({
            "run_id": run_id, "worker_name": self.worker_name, "analyzer_name": self.analyzer_name,
            "config_file": str(self.config_path) if self.config_path else None, "prompts": len(res),
            "request_ids": [r.request_id for r in res]}, indent=1))
        return run_id

    def load_run(self, run_id: str) -> list[Results]:
        folder = self.hook_dir / run_id
        meta = folder / "run.json"
        if not meta.is_file():
            raise ValueError(f"no run {run_id!r} in {self.hook_dir} (runs: {self.runs()[:8]})")
        n = json.loads(meta.read_text())["prompts"]
        return [Results.load(folder / f"{i:05d}.safetensors") for i in range(n)]

    def runs(self) -> list[str]:
        return sorted(q.parent.name for q in self.hook_dir.glob("*/run.json"))

    # ---- analyze ------------------------------------------------------------------------
    def analyze(self, analyzer_spec: dict | None = None, run_id: str | None = None,
                probes: Sequence[Results] | None = None) -> dict | None:
        """The analyzer over `probes` (Results in memory), the run `run_id`, or the last
        `generate` (its run folder when it saved one). None without an analyzer."""
        if self.analyzer is None:
            return None
        if probes is not None:
            res = list(probes)
        elif run_id is not None:
            res = self.load_run(run_id)
        elif self.last_run_id is not None:
            res = self.load_run(self.last_run_id)
        elif self._last is not None:
            res = self._last
        else:
            raise ValueError("nothing to analyze: generate() first, or pass run_id= or probes=")
        return self.analyzer(res, analyzer_spec or {})


def _read_config(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {str(path)!r} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a JSON object")
    return data


def _mode(mode: str, where: Any) -> str:
    if mode not in MODES:
        raise ValueError(f"{where}: mode {mode!r}: use one of {list(MODES)}")
    return MODES[mode]


def _load_vector(path: Path, layer: int) -> torch.Tensor:
    if not path.is_file():
        raise ValueError(f"steering vector file {str(path)!r} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        found = list(load_file(str(path)).values())
        if len(found) != 1:
            raise ValueError(f"{path} holds {len(found)} tensors; keep one (the vector)")
        t = found[0]
    else:
        t = torch.load(str(path), map_location="cpu", weights_only=True)
        if isinstance(t, dict):
            t = t.get(layer, t.get(str(layer)))
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{path}: expected a tensor (or a dict of tensors by layer)")
    if t.dim() == 2:
        t = t[layer]
    return t.float().flatten()


def _merge(a: dict | None, b: dict | None) -> dict | None:
    if not a or not b:
        return a or b
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, []) + v if isinstance(v, list) else v
    return out


def _ranges(spec_range, prompt_len: int) -> tuple[int, int]:
    a, b = int(spec_range[0]), int(spec_range[1])
    return (a + prompt_len if a < 0 else a, b + prompt_len if b < 0 else b)


class _Adapter:
    """An analyzer called with vLLM-Hook's `analyzer_spec`, answering its dict shape."""

    def __init__(self, name: str, config: dict):
        self.name = name
        params = config.get("params") or {}
        if name == "attention_tracker":
            heads = params.get("important_heads") or []
            self.impl = get_analyzer(name)(important_heads=[[int(L), int(h)] for L, h in heads],
                                           **({"threshold": params["threshold"]} if "threshold" in params else {}))
        elif name == "core_reranker":
            heads = params.get("important_heads") or "all"
            self.impl = get_analyzer(name)(heads=[[int(L), int(h)] for L, h in heads] if heads != "all" else heads)
        else:
            self.impl = None

    def __call__(self, res: list[Results], spec: dict) -> dict:
        if self.name == "attention_tracker":
            ranges = spec.get("input_range")
            if ranges is None:
                raise ValueError("analyzer_spec needs input_range: ((instruction start, end), (data start, end)), "
                                 "one per prompt for a batch")
            per = ranges if len(res) > 1 or _nested(ranges) else [ranges]
            if len(per) != len(res):
                raise ValueError(f"input_range has {len(per)} entries for {len(res)} prompts")
            out = [self.impl.analyze(r, spans={"instruction": _ranges(p[0], r.prompt_len),
                                               "data": _ranges(p[1], r.prompt_len)}) for r, p in zip(res, per)]
            return {"score": [o.focus_score for o in out], "injected": [o.injected for o in out],
                    "results": out}
        if self.name == "core_reranker":
            docs, query = spec.get("doc_spans"), spec.get("query_span")
            if docs is None or query is None:
                raise ValueError("analyzer_spec needs doc_spans and query_span (one list per prompt for a batch)")
            if len(res) == 1 and not isinstance(query[0], (list, tuple)):
                docs, query = [docs], [query]
            out = [self.impl.analyze(r, d, q) for r, d, q in zip(res, docs, query)]
            return {"scores": [list(o.scores) for o in out], "ranking": [list(o.ranking) for o in out],
                    "results": out}
        # hidden_states: {"hidden_states": {layer: [per prompt]}}, reduce none / mean / norm
        reduce = spec.get("reduce", "none")
        if reduce not in ("none", "mean", "norm"):
            raise ValueError(f"reduce {reduce!r}: use none, mean or norm")
        hs: dict[int, list] = {}
        for r in res:
            for L, t in sorted(r.activations.get("resid_post", {}).items()):
                v = t if reduce == "none" else t.mean(0) if reduce == "mean" else t.norm(dim=-1)
                hs.setdefault(L, []).append(v)
        return {"hidden_states": hs}


def _nested(x) -> bool:
    return bool(x) and isinstance(x[0], (list, tuple)) and bool(x[0]) and isinstance(x[0][0], (list, tuple))


def _analyzer(name: str, config: dict) -> _Adapter:
    ours = ANALYZERS.get(name, name)
    if ours not in ("attention_tracker", "core_reranker", "hidden_states"):
        raise ValueError(f"unknown analyzer_name {name!r}; one of {sorted(ANALYZERS)} (vLLM-Hook's) or "
                         "attention_tracker / core_reranker; other analyzers of ours take Results "
                         "directly (docs/analyzers.md)")
    return _Adapter(ours, config)
