"""Frontend admission: validate each request's spec before it is queued, then rewrite it into
the wire form workers read, salt the prefix cache by the steering, and keep a record for
result delivery. Errors raise `SpecError` (a ValueError): `LLM.generate` raises it, the
OpenAI server answers HTTP 400.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from ..adapters.requests import add_cache_salt, params_of, prompt_len_of, resumable
from ..spec.errors import SpecError
from ..spec.lens import has_lens_args, translate
from ..spec.rescale import rescaled, split, template
from ..spec.resolve import Resolved, capture_bytes, resolve
from ..spec.schema import SPEC_KEY, parse_spec
from .cache import cache_key, call_key
from .state import SERVED, allow_pickles, maybe_state, state_of

class Sealed:
    """A raw spec riding through vLLM's copy of the request's SamplingParams untouched."""

    __slots__ = ("raw",)

    def __init__(self, raw: Any):
        self.raw = raw

    def __deepcopy__(self, memo: dict) -> "Sealed":
        return self

    def __copy__(self) -> "Sealed":
        return self


class sealed:
    """`with sealed(params):` while vLLM processes a request, its raw spec as one opaque
    object. vLLM deep-copies each request's SamplingParams (and walks its extra_args): for a
    28-op spec +140 µs a request, more than the spec's whole admission, on a copy `_admit`
    replaces by the wire form anyway. Spec text (served) and no spec are left as they are. The
    caller's params are restored after (a user may pass one for many prompts). A class, not a
    generator context manager: entered for every request."""

    __slots__ = ("params", "extra")

    def __init__(self, params: Any):
        self.params, self.extra = params, None

    def __enter__(self) -> None:
        extra = getattr(self.params, "extra_args", None)
        raw = extra.get(SPEC_KEY) if isinstance(extra, dict) else None
        if raw is not None and not isinstance(raw, (str, bytes, Sealed)):
            self.extra = extra
            self.params.extra_args = {**extra, SPEC_KEY: Sealed(raw)}

    def __exit__(self, *exc) -> None:
        if self.extra is not None:
            self.params.extra_args = self.extra


def _hooked(request: Any, sp: Any) -> None:
    """Python hooks see (and may change) every row: a hooked request reads no cached prefix
    (its hooks would miss those rows) and leaves no KV anyone else reuses (a unique salt)."""
    add_cache_salt(request, f"vllm_hook:hooks:{uuid.uuid4().hex}")
    sp.skip_reading_prefix_cache = True


def _check_capture_bytes(st, res, prompt_len: int, sp: Any) -> int:
    """Refuse a request whose captures could exceed max_capture_bytes_per_request (worst case:
    max_tokens generated; per request, since max_tokens is not part of the cached spec)."""
    limit = st.capture_limit()
    max_tokens = getattr(sp, "max_tokens", None)
    total = min(prompt_len + (max_tokens if max_tokens is not None else st.max_model_len), st.max_model_len)
    worst = res.worst_bytes.get((prompt_len, total))
    if worst is None:
        worst = capture_bytes(res.items, st.info, prompt_len, total)
        if len(res.worst_bytes) < 256:      # a batch repeats a few lengths
            res.worst_bytes[(prompt_len, total)] = worst
    if worst > limit:
        raise SpecError("capture", f"its captures could take {worst:,} bytes of host memory on a worker "
                        f"(every selected row over {prompt_len} prompt + up to {total - prompt_len} "
                        f"generated tokens), more than max_capture_bytes_per_request ({limit:,})",
                        "capture fewer layers or tokens, lower max_tokens, or raise additional_config "
                        "vllm_hook.max_capture_bytes_per_request")
    return worst


def _widen_on_device(st, res, worst: int) -> None:
    """Ask the workers for float32 rows (wire "W": `delivery.collector`'s `_wide_pools`) where
    the frontend would widen them anyway: an offline float32 request of a model computing in
    bf16 or fp16 whose rows all come from its prompt (prompt selectors, or one token
    generated: no decode rows, whose joining converts them anyway), whose float32 rows fit
    max_capture_bytes_per_request. The device converts (its time not yet measured) what cost
    the frontend's read 56 µs more a hooked request of the mixed prefill-only batch (63
    against 7, run 149), and the big capture's 1.4 GB in bf16 made 2.8 GB of fresh float32
    memory there (2.97x a plain batch, run 51); the copy to the host doubles. A block the
    worker's in-flight budget has no room for in float32, or one above 1 MiB its arena has
    none for, goes in the model's dtype (`delivery.collector`), widened by the frontend as
    before. Not served: there rows travel in the model's dtype and the client widens them
    (`Results.widen_to`). Not attention scores (float32 already)."""
    wide = 2 * worst             # float32 rows of a 2-byte dtype
    if (not res.widen_when or st.info.dtype not in ("bfloat16", "float16") or SERVED["on"]
            or res.dtype != "float32" or not wide or wide > st.capture_limit()):
        return
    if res.widen_when == 2 or (res.widen_when == 1 and res.wire.get("M") == 1):
        res.wire["W"] = 1


def _bound(st, request: Any, sp: Any, res: Resolved) -> None:
    """Put the request's max_tokens on its wire ("M"): its last forwarded position is
    prompt_len + max_tokens - 2 (the last token is sampled, never forwarded), where workers
    end its open-ended routes. Not where positions may pass it: draft tokens (speculative
    decoding, diffusion) or a resumable request (a streamed input's next chunk resets
    max_tokens); nothing is forwarded past max_model_len."""
    max_tokens = getattr(sp, "max_tokens", None)
    if (st.drafts or resumable(request) or not isinstance(max_tokens, int)
            or isinstance(max_tokens, bool) or max_tokens < 1):
        return
    res.wire["M"] = min(max_tokens, st.max_model_len)


def admit(input_processor: Any, request_id: str, request: Any) -> None:
    """Resolve the spec carried by `request` (an EngineCoreRequest) in place."""
    t0 = time.perf_counter()
    _admit(input_processor, request_id, request)
    st = maybe_state(input_processor)
    if st is not None:
        st.timing["admitted"] += 1
        st.timing["admit_s"] += time.perf_counter() - t0


def _resolved(st, raw: Any, prompt_len: int) -> Resolved | None:
    """The request's own resolution of spec `raw` (None: the spec asks for nothing): kept
    ones copied where the cache has the spec (`frontend.cache`: parsed here, or made from
    its shape's template before), or its shape (`spec.rescale`), else parsed and resolved."""
    cache, keep = call_key(raw)
    spec = st.resolved.spec(cache) if cache is not None else None
    shape = shape_key = t = None
    if spec is None:
        res = st.resolved.resolved(cache, prompt_len) if cache is not None else None
        if res is not None:              # resolved from its shape before
            return res
        shape = split(raw) if cache is not None else None
        if shape is not None:
            shape_key = cache_key(shape[0])[0]
            t = st.resolved.shape(shape_key, prompt_len) if shape_key is not None else None
            res = rescaled(t, shape[1], prompt_len) if t is not None else None
            if res is not None:
                # kept by its exact content too: a sweep's later requests at this strength
                # are a lookup (the kept one is never a request's: `put` hands out a copy)
                return st.resolved.put(cache, prompt_len, res, keep, t.positional)
        spec = parse_spec(raw)
        if cache is not None:
            st.resolved.put_spec(cache, spec, keep)
    if spec.is_empty:
        return None
    positional = spec.positional
    res = st.resolved.get(cache, prompt_len, positional) if cache is not None else None
    if res is None:
        res = resolve(spec, st.info, st.cfg, prompt_len, st.names.get, st.max_model_len,
                      allow_pickles=allow_pickles(st))
        if cache is not None:
            # (a kept template that refused this spec's numbers is kept as it is)
            if shape_key is not None and t is None and st.resolved.second_sight(shape_key):
                st.resolved.put_shape(shape_key, prompt_len, positional,
                                      template(spec, res, st.info, st.cfg.max_ops_per_layer))
            res = st.resolved.put(cache, prompt_len, res, keep, positional)
    return res


def _admit(input_processor: Any, request_id: str, request: Any) -> None:
    sp = params_of(request)
    extra = getattr(sp, "extra_args", None)
    if isinstance(extra, dict) and isinstance(extra.get(SPEC_KEY), Sealed):
        extra = {**extra, SPEC_KEY: extra[SPEC_KEY].raw}
    stack = None
    if has_lens_args(extra):
        extra, stack = translate(extra)
        sp.extra_args = extra
    if not extra or SPEC_KEY not in extra:
        st = maybe_state(input_processor)
        if st is not None and st.persistent_hooks and sp is not None:
            _hooked(request, sp)
        return
    st = state_of(input_processor)
    raw = extra[SPEC_KEY]
    rest = {k: v for k, v in extra.items() if k != SPEC_KEY}
    prompt_len = prompt_len_of(request)
    res = _resolved(st, raw, prompt_len)
    if res is None:                      # an empty spec
        sp.extra_args = rest or None
        if st.persistent_hooks:
            _hooked(request, sp)
        return
    if stack is not None:
        res = dataclasses.replace(res, stack_layers=tuple(stack))
    if res.items:
        worst = _check_capture_bytes(st, res, prompt_len, sp)
        _bound(st, request, sp, res)
        _widen_on_device(st, res, worst)
    elif not res.hooks and not st.persistent_hooks and getattr(sp, "n", 1) == 1:
        # Steering only: delivered without a fetch if its workers mark it clean. Not n > 1:
        # its children would share one ticket, and one child's clean mark hide another's error.
        res.ticket = res.wire["t"] = st.next_ticket()
    sp.extra_args = {**rest, SPEC_KEY: res.wire}
    if res.steer_digest:
        # A steered request must never reuse KV computed under other steering (or none).
        add_cache_salt(request, f"vllm_hook:{res.steer_digest}")
    if res.reads_cached_prefix:
        # Cached prefix tokens are not recomputed, so their activations would not exist.
        sp.skip_reading_prefix_cache = True
    if res.hooks or st.persistent_hooks:
        _hooked(request, sp)
    st.add_pending(request_id, res)
    if st.first_tokens is not None and not st.persistent_hooks and getattr(sp, "n", 1) == 1 \
            and res.whole_at_prefill:
        st.first_tokens.add(request, request_id)      # fetched once its prompt is done

