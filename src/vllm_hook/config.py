"""The one engine-level configuration object of vllm-hook.

Engine-wide settings travel in vLLM's ``additional_config["vllm_hook"]`` (a dict), so every
vLLM process sees the same values and vLLM hashes them into its compile-cache key: a graph
compiled without the plugin, or with other settings, is never reused. Per-request settings
live in the request spec (``spec.py``), never here. The only environment variable is the
kill switch ``VLLM_HOOK_DISABLE=1``.
"""

from __future__ import annotations

import difflib
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import __version__

CONFIG_KEY = "vllm_hook"
SITES = ("resid_post", "resid_pre", "attn_out", "mlp_out", "q", "k")
Site = Literal["resid_post", "resid_pre", "attn_out", "mlp_out", "q", "k"]
# Sites a request may ask for; attn_scores is computed from the captured q (needs site "q").
SpecSite = Literal["resid_post", "resid_pre", "attn_out", "mlp_out", "q", "k", "attn_scores"]


class ConfigError(ValueError):
    """A bad engine setting: names the key, what is wrong and the fix (raised at engine start)."""

    @classmethod
    def of(cls, err: ValidationError) -> "ConfigError":
        e = err.errors()[0]
        key = str(e["loc"][0]) if e["loc"] else "?"
        where = f"additional_config {CONFIG_KEY}.{'.'.join(str(p) for p in e['loc'] if '[' not in str(p))}"
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(key, HookConfig.model_fields, n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            return cls(f"{where}: unknown setting. Fix: {hint}the settings are listed in docs/config.md")
        field = HookConfig.model_fields.get(key)
        doc = f" ({field.description.split('. ')[0]})" if field is not None and field.description else ""
        msgs = [x["msg"].replace("Input should be ", "expected ") for x in err.errors()
                if x["loc"][:1] == e["loc"][:1]]
        msg = " or ".join(dict.fromkeys(msgs))          # several when a union's branches all failed
        return cls(f"{where}: {msg}, got {e.get('input')!r}. Fix: see {key}{doc} in docs/config.md")


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def disabled() -> bool:
    """True when ``VLLM_HOOK_DISABLE`` is set to a true value: the plugin is then a no-op."""
    return os.environ.get("VLLM_HOOK_DISABLE", "").strip().lower() in ("1", "true", "yes", "on")


class HookConfig(BaseModel):
    """Engine-level settings (``LLM(..., additional_config={"vllm_hook": {...}})``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sites: tuple[Site, ...] = Field(
        default=("resid_post", "resid_pre"),
        description="Capture sites instrumented in the model. resid_post/resid_pre (and additive "
        "steering) fuse into kernels the model runs anyway and cost nothing when unused; attn_out, "
        "mlp_out, q and k (post-RoPE attention inputs; attn_scores needs q) each add a small "
        "kernel per instrumented layer and step, so they are opt-in. Requests for an "
        "uninstrumented site are refused with an error naming this setting.",
    )
    site_layers: list[int] | Literal["all"] = Field(
        default="all",
        description="Layers where the opt-in sites (attn_out, mlp_out, q, k) are instrumented.",
    )
    steer_layers: list[int] | Literal["all"] | None = Field(
        default="all",
        description="Layers where additive steering may run. It fuses into the next layer's "
        "add+RMSNorm kernel, but that kernel then loads the request's op rows every step (a few "
        "percent of decode time when no request steers, docs/benchmarks.md); an engine that never "
        "steers at a layer can leave it out and pay nothing there. Projection layers always steer.",
    )
    projection_layers: list[int] | Literal["all"] | None = Field(
        default=None,
        description="Layers where cap, ablate and norm-matched add may run. Each costs one extra "
        "reduction kernel per step at that layer; additive steering needs none and runs anywhere.",
    )
    max_ops_per_layer: int = Field(
        default=2, ge=1, le=8,
        description="Steering ops one request may apply to one token at one layer (ops on disjoint token lists share a slot; each slot is one fused step).",
    )
    max_vectors: int = Field(
        default=256, ge=1,
        description="Distinct steering vectors resident on the device at once.",
    )
    max_named_vectors: int = Field(
        default=1024, ge=1,
        description="Named steering vectors an engine keeps (register_vectors, POST "
        "/v1/hook/vectors); each takes hidden_size x 4 bytes on every worker and in the "
        "frontend. Registering beyond it is refused; delete vectors to make room.",
    )
    capture_pool_rows: int | None = Field(
        default=None, ge=1,
        description="Rows of the per-step device capture buffer (one row = one token at one "
        "site and layer), per pool (residual, q, k). Default: max(2 x max_num_batched_tokens, 8192).",
    )
    index_asserts: bool = Field(
        default=False,
        description="Keep Inductor's device-side bounds checks on indexed loads and stores "
        "(its assert_indirect_indexing) in the compiled model. Off by default: the capture "
        "scatter's check made every layer's fused norm kernel 1.2 us slower, every step (H200, "
        "docs/benchmarks.md), and the plugin writes only indices it allocated. The setting "
        "covers the whole compiled model; on the H200 it changed none of native vLLM's kernels "
        "(vLLM itself turns off Inductor's size and alignment asserts for speed).",
    )
    result_spill_dir: str | None = Field(
        default="/dev/shm",
        description="Where workers put fetched results for a frontend that shares their "
        "/dev/shm (it keeps a probe file there that the worker must see; the frontend maps "
        "each result file and deletes it at once), instead of sending them through vLLM's "
        "RPC. None, another host or container, or a full or unwritable directory: the RPC.",
    )
    result_arena_bytes: int | None = Field(
        default=None, ge=0,
        description="A worker's shared result arena: captured blocks of 64 KiB and more (a "
        "prompt's rows) are copied from the device straight into it (page-locked once) and "
        "reach a frontend on the same host without another copy; its results view the arena "
        "until they are freed. When full, or 0, results are written per fetch instead. Made "
        "when the engine starts (page-locked on a GPU host). Default: 1/16 of the host's memory "
        "over its GPUs, from 1 to 4 GiB per worker (docs/architecture.md, delivery).",
    )
    max_capture_bytes_per_request: int | None = Field(
        default=None, ge=1,
        description="Host bytes one request's captures may take on a worker in the worst case "
        "(every selected row of every captured layer over its prompt and max_tokens, in the "
        "model's dtype); a spec beyond it is refused at admission. Default: 1/8 of the host's "
        "memory.",
    )
    max_inflight_capture_bytes: int | None = Field(
        default=None, ge=1,
        description="Host bytes of captures a worker holds for all its unfetched requests; a "
        "request whose rows would pass it loses its captures (an error in its results), the "
        "others keep theirs. Default: 1/2 of the host's memory.",
    )
    max_inline_result_bytes: int = Field(
        default=1 << 20, ge=0,
        description="Served mode: results up to this size travel inline in the response (base64 in "
        "JSON), larger ones by handle (binary): MB-size results cost about half as much by handle.",
    )
    result_ttl_s: float = Field(
        default=600.0, gt=0,
        description="Served mode: retained results not fetched within this time are dropped.",
    )
    max_retained_bytes: int = Field(
        default=4 << 30, ge=0,
        description="Served mode: upper bound on retained results; the oldest are dropped first.",
    )
    local_results: bool = Field(
        default=True,
        description="Served mode: a client that asks for it (`vllm_hook.Client` and `AsyncClient` "
        "do, by default for a server at a loopback address) gets results too large to inline as "
        "files in result_spill_dir (mode 0600), which it reads where it can open them, and "
        "fetches by handle otherwise; they count toward max_retained_bytes. Off, or "
        "result_spill_dir null: by handle only.",
    )
    max_request_bytes: int = Field(
        default=64 << 20, ge=1024,
        description="Served mode: larger request bodies on plugin routes are refused (HTTP 413).",
    )
    hook_layers: list[int] | Literal["all"] | None = Field(
        default=None,
        description="Layers where Python hooks may run (pre and post): each such layer gets a "
        "hook point, a splitting op of vLLM's piecewise CUDA graphs (docs/hooks.md). An engine "
        "without hook layers runs no hook code at all; a request hooking another layer is "
        "refused with an error naming this key.",
    )
    hook_modules: list[str] = Field(
        default_factory=list,
        description="Importable modules that register operator hooks (@vllm_hook.operator_hook), "
        "which clients call by name with JSON arguments. Entry points of the group "
        "vllm_hook.hooks are loaded too.",
    )
    hook_graphs: bool = Field(
        default=True,
        description="GPU: a steady decode step whose Python hooks are all batched, read-only and "
        "graphable (the logit lens, stream_norms) replays their kernels from a CUDA graph of "
        "its own, captured once the batch has held still for a few steps; off: they run "
        "eagerly every step (docs/hooks.md).",
    )
    max_hook_state_bytes: int = Field(
        default=1 << 30, ge=0,
        description="Tensor bytes one request's hook (its ctx.saved) may hold; beyond it the "
        "hook fails for that request with an error.",
    )
    max_persistent_hook_results: int = Field(
        default=10000, ge=1,
        description="Requests whose persistent-hook results a worker keeps until collected "
        "or cleared; the oldest are dropped beyond it (counted in stats).",
    )
    allow_client_code: bool = Field(
        default=False,
        description="Served mode: accept client-supplied Python hooks (cloudpickle): remote "
        "code execution on the server. Off: clients may only call operator hooks by name.",
    )
    allow_untested_vllm: bool = Field(
        default=False,
        description="Start on a vLLM release outside the tested range (a warning, not an "
        "error), at your own risk: its runner internals may differ from what the adapters read.",
    )
    version: str = __version__

    def capture_limits(self) -> tuple[int, int]:
        """(bytes per request, bytes in flight per worker), defaults from the host's memory."""
        mem = host_memory_bytes()
        return (self.max_capture_bytes_per_request or mem // 8, self.max_inflight_capture_bytes or mem // 2)

    def arena_bytes(self) -> int:
        """Size of each worker's shared result arena (0: none)."""
        if self.result_arena_bytes is not None:
            return self.result_arena_bytes
        return min(4 << 30, max(1 << 30, host_memory_bytes() // 16 // _local_devices()))

    def layers_of(self, value, num_layers: int) -> set[int]:
        if value is None:
            return set()
        if value == "all":
            return set(range(num_layers))
        return {v % num_layers for v in value if -num_layers <= v < num_layers}

    def hook_boundaries(self, num_layers: int) -> set[int]:
        """Hook points: boundary b is the stream entering layer b (pre hooks of b, post
        hooks of b - 1); b = num_layers is after the last layer."""
        layers = self.layers_of(self.hook_layers, num_layers)
        return layers | {L + 1 for L in layers}

    def steering_layers(self, num_layers: int) -> set[int]:
        """Layers whose instrumented graph contains the steering math."""
        return (self.layers_of(self.steer_layers, num_layers)
                | self.layers_of(self.projection_layers, num_layers))

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "HookConfig":
        extra = getattr(vllm_config, "additional_config", None) or {}
        return cls.from_additional_config(extra)

    @classmethod
    def from_additional_config(cls, extra: dict | None) -> "HookConfig":
        raw = (extra or {}).get(CONFIG_KEY) or {}
        if isinstance(raw, HookConfig):
            return raw
        if not isinstance(raw, dict):
            raise ConfigError(f'additional_config["{CONFIG_KEY}"] must be an object of settings, got '
                              f"{type(raw).__name__}. Fix: e.g. {{\"{CONFIG_KEY}\": {{\"sites\": "
                              '["resid_post", "q"]}} (docs/config.md)')
        try:
            return cls(**{k: v for k, v in raw.items() if k != "version"})
        except ValidationError as e:
            raise ConfigError.of(e) from None

    def stamp(self) -> dict:
        """Plain dict for ``additional_config`` (hashed by vLLM into its compile-cache key)."""
        return self.model_dump(mode="json")


def _local_devices() -> int:
    """GPUs on this host (1 without any): each may run a worker with its own arena."""
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except Exception:
        return 1
