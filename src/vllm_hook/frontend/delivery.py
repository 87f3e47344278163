"""Fetch finished requests' captures from the workers and attach `Results` to the outputs."""

from __future__ import annotations

import asyncio
import logging
import resource
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..delivery.arena import FRONTEND as ARENAS
from ..delivery.hostmem import RECYCLER, one_thread
from ..delivery.nogc import no_gc
from ..delivery.spill import hand_back, open_entry, spill_target
from ..delivery.store import parse_batch
from ..results import ATTR, Results, build
from .state import FrontendState

RPC = "vllm_hook_call"
log = logging.getLogger("vllm_hook")


def fetch_args(st: FrontendState, keys: list[str], running: bool = False) -> tuple:
    """The RPC arguments that fetch (and forget) the workers' results of `keys`: where to
    spill, and the workers' arenas this process has mapped (they may lend from those);
    `running`: requests still decoding (`FetchBatcher.hold`)."""
    args = ("fetch", keys, spill_target(st.cfg.result_spill_dir), ARENAS.tokens())
    return (*args, True) if running else args


def checked(replies: Sequence[Any]) -> Sequence[Any]:
    """Raise the error a worker without an active runtime answers with (see worker_rpc)."""
    for reply in replies:
        if isinstance(reply, dict) and "error" in reply and len(reply) == 1:
            raise RuntimeError(reply["error"])
    return replies


def count_rpc(st: FrontendState, replies: Sequence[Any], sent: float) -> None:
    """Split a fetch RPC's time (`sent`: time.monotonic() before it) into the way to the
    worker (the engine core picks the call up between steps) and the way back, from rank 0's
    stamps of when its fetch ran. Skipped when they cannot be of this host's clock."""
    got = time.monotonic()
    ran = replies[0].get("ran") if replies and isinstance(replies[0], dict) else None
    if isinstance(ran, (list, tuple)) and len(ran) == 2 and sent <= ran[0] <= ran[1] <= got:
        st.timing["rpc_to_worker_s"] = st.timing.get("rpc_to_worker_s", 0.0) + ran[0] - sent
        st.timing["rpc_back_s"] = st.timing.get("rpc_back_s", 0.0) + got - ran[1]


def merge_ranks(replies: Sequence[Any], st: FrontendState | None = None) -> dict[str, list[dict]]:
    """collective_rpc returns one reply per worker (TP rank): rank 0 has the residual stream,
    every rank its shard of the attention heads. Each entry refers to its rank's payload.
    `st`: notes each rank's arena, where later requests' clean marks are read."""
    if st is not None:
        st.arena_tokens = tuple(r.get("arena_token") if isinstance(r, dict) else None for r in replies)
    merged: dict[str, list[dict]] = {}
    for reply in replies:
        if isinstance(reply, dict):
            ARENAS.adopt(reply.get("arena"))       # offered: lent from at the next fetch
            for part in _parts(reply):
                payload = part.get("batch")
                if isinstance(payload, dict) and payload.get("lent"):
                    # Viewed now: if anything below fails, the views die with the replies and
                    # the pieces go back to the worker.
                    payload["views"] = ARENAS.views(payload["lent"])
    for reply in checked(replies):
        for part in _parts(reply or {}):
            payload = part.get("batch")
            for key, entries in (part.get("entries") or {}).items():
                merged.setdefault(key, []).extend({**e, "payload": payload} for e in entries)
    return merged


def _parts(reply: dict) -> list[dict]:
    """A rank's reply: its payload and entries, and those of replies its worker made ahead
    ("more": `worker.prepared`), each with payload and entries of its own."""
    more = reply.get("more")
    return [reply, *more] if more else [reply]


class Opened:
    """Payloads read once, however many requests' entries refer to them. A payload file of
    the batch (`expect`) that no request read, because their clients went away or their build
    failed first, is handed back when the batch is dropped, not left in the spill directory."""

    def __init__(self):
        self._bufs: dict[int, tuple[Any, Any]] = {}
        self._parsed: dict[tuple[int, str, bool], list] = {}
        self._unread: dict[int, str] = {}
        weakref.finalize(self, _hand_back_all, self._unread)

    def expect(self, merged: dict[str, list[dict]]) -> "Opened":
        """Note the payload files `merged`'s entries refer to."""
        for entries in merged.values():
            for e in entries:
                p = e.get("payload")
                if isinstance(p, dict) and "path" in p:
                    self._unread.setdefault(id(p), p["path"])
        return self

    def part(self, entry: dict, dtype: str = "float32", lend_float32: bool = False, join: bool = True) -> tuple:
        """(points, metadata, owned) of one request's entry, its rows packed with others'
        already in `dtype` (`parse_batch`: one conversion per payload and dtype;
        `lend_float32`: the model's dtype is narrower, see there; `join`: see there)."""
        payload = entry["payload"]
        got = self._bufs.get(id(payload))
        if got is None:
            self._unread.pop(id(payload), None)
            got = self._bufs[id(payload)] = (payload, open_entry(payload))
        buf = got[1]
        parts = self._parsed.get((id(payload), dtype, join))
        if parts is None:
            parts = self._parsed[(id(payload), dtype, join)] = parse_batch(buf, dtype, payload.get("views"),
                                                                           lend_float32, join)
        points, meta = parts[entry["j"]]
        return points, meta, isinstance(buf, torch.Tensor) or bool(meta.get("_owned"))


def _hand_back_all(paths: dict[int, str]) -> None:
    for path in paths.values():
        hand_back(path)


def release(replies: Sequence[Any] | None) -> None:
    """Hand back the payload files of fetch replies that will not be read (the fetch failed
    after a worker wrote its file)."""
    for r in replies or ():
        for part in _parts(r) if isinstance(r, dict) else ():
            payload = part.get("batch")
            if isinstance(payload, dict) and "path" in payload:
                hand_back(payload["path"])


def child_index(req_id: str, n: int) -> int:
    """vLLM names the children of an n > 1 request `{index}_{parent id}`."""
    if n <= 1:
        return 0
    head = req_id.split("_", 1)[0]
    return int(head) if head.isdigit() else 0


def results_for(st: FrontendState, output: Any, entries: list[dict], res,
                opened: Opened | None = None, *, wire: bool = False) -> Results | list[Results]:
    """The results of one finished request. `wire`: they are for a served response, where a
    float32 request's rows stay in the model's dtype and are widened where the client loads
    them (`Results.widen_to`)."""
    if not entries:
        # Nothing to read or convert (steering only, or a fetch that brought nothing):
        # torch's thread count left as it is (two calls a request, served).
        with no_gc():
            return _results_for(st, output, entries, res, opened, wire)
    with no_gc(), one_thread():   # see _attach_all; small tensors: see hostmem.one_thread
        return _results_for(st, output, entries, res, opened, wire)


def _results_for(st: FrontendState, output: Any, entries: list[dict], res,
                 opened: Opened | None, wire: bool) -> Results | list[Results]:
    if not entries and not res.fetches and not res.save_dir:
        return _tokens_only(st, output, res, wire)
    return _built(st, output, entries, res, opened, wire)


def _tokens_only(st: FrontendState, output: Any, res, wire: bool) -> Results | list[Results]:
    """The Results of a request that are its tokens (steering only): what `_built` makes of no
    rows, without `build`'s walk (served, every steered request of a batch at once)."""
    t0 = time.perf_counter()
    built = _of_tokens(output, st.info.name)
    if _widens(st, res, wire):
        for r in built:
            r.widen_to = "float32"
    st.timing["build_s"] += time.perf_counter() - t0
    return built[0] if len(built) == 1 else built


def _of_tokens(output: Any, model: str = "", errors: Sequence[str] = ()) -> list[Results]:
    """A Results of nothing but its tokens (and `errors`) per choice of `output`."""
    prompt = getattr(output, "prompt_token_ids", None) or []
    outs = list(getattr(output, "outputs", None) or []) or [None]
    return [Results(request_id=str(output.request_id), prompt_len=len(prompt),
                    token_ids=[*prompt, *(c.token_ids if c is not None else ())],
                    index=getattr(c, "index", i) if c is not None else 0, model=model,
                    errors=list(errors)) for i, c in enumerate(outs)]


def _widens(st: FrontendState, res, wire: bool) -> bool:
    """Served float32 results travel in the model's dtype and are widened where loaded."""
    return wire and res.dtype == "float32" and st.info.dtype != "float32"


def _built(st: FrontendState, output: Any, entries: list[dict], res,
           opened: Opened | None, wire: bool) -> Results | list[Results]:
    widen = _widens(st, res, wire)
    dtype = "model" if widen else res.dtype
    outs = list(getattr(output, "outputs", []) or [])
    n = max(len(outs), 1)
    by_index: dict[int, list] = {}
    lost: dict[int, list[str]] = {}
    opened = opened or (Opened() if entries else None)
    narrow = st.info.dtype != "float32"
    t0 = time.perf_counter()
    for e in entries:
        i = child_index(e["req_id"], n)
        try:
            # served: a request's rows lent in several parts left as those, which its
            # encoding writes from (`parse_batch`)
            by_index.setdefault(i, []).append(opened.part(e, dtype, narrow, join=not wire))
        except OSError as err:          # the spilled file vanished (e.g. deleted by hand)
            lost.setdefault(i, []).append(f"the captured results could not be read: {err}")
    t1 = time.perf_counter()
    built = []
    for i, comp in enumerate(outs or [None]):
        idx = getattr(comp, "index", i) if comp is not None else 0
        blobs = by_index.get(idx)
        errs = lost.get(idx, []) + ([] if blobs or not res.fetches else [
            "no results arrived from the workers for this request"])
        r = build(blobs, res.items, st.points, request_id=str(output.request_id),
                  prompt_token_ids=output.prompt_token_ids or [],       # `build` copies them
                  output_token_ids=comp.token_ids if comp is not None else [],
                  index=idx, model=st.info.name, extra_errors=errs, head_size=st.info.head_dim,
                  dtype=dtype, hooks=res.hooks)
        if widen:
            r.widen_to = "float32"
        if wire and any(not isinstance(t, torch.Tensor) for acts in r.activations.values() for t in acts.values()):
            st.timing["results_from_parts"] += 1      # rows left as the worker's parts (`parse_batch`)
        if res.save_dir:
            suffix = f"_{idx}" if n > 1 else ""
            r.save(Path(res.save_dir) / f"{output.request_id}{suffix}.safetensors")
        built.append(r)
    st.timing["read_s"] += t1 - t0
    st.timing["build_s"] += time.perf_counter() - t1
    return built[0] if n == 1 else built


def nothing_to_fetch(st: FrontendState, res, count: bool = True) -> bool:
    """A steering-only request every rank has marked clean: its results are its tokens. Any
    other (captures, hooks, an error on a worker, an arena not mapped yet) is fetched: a
    worker-side failure (a full vector table, a vector deleted before it ran) must reach it."""
    if res.ticket and (res.clean or ARENAS.clean(st.arena_tokens, res.ticket)):
        # Asked twice a served request, both after its finish (its early fetch, then its
        # delivery, milliseconds apart): read once. A mark withdrawn in between (a worker's
        # note to finished requests, `turn_off`) is not seen: that window is accepted.
        res.clean = True
        if count:
            st.timing["delivered_without_fetch"] += 1
        return True
    return False


def fetch_keys(st: FrontendState, request_ids: Sequence[str]) -> list[str]:
    """The keys of the pending requests among `request_ids` that have results to fetch."""
    keys = []
    for rid in request_ids:
        item = st.pending.get(rid)
        if item is not None and not item[1].held and not nothing_to_fetch(st, item[1], count=False):
            keys.append(item[1].key)
    return keys


@dataclass
class Early:
    """A fetch sent when the engine's last step of an offline call came back, before vLLM
    processed its outputs (`adapters.frontend`): the engine core fetches while this process
    turns the step into RequestOutputs, and `attach` finds the reply there or nearly."""

    keys: list[str]
    wait: Callable[[float | None], list]     # the reply (per rank); a timeout in seconds
    sent: float                              # time.monotonic() when sent


def send_early(st: FrontendState, request_ids: Sequence[str], send: Callable[[str, tuple], Callable]) -> None:
    """Fetch now the results of `request_ids` (external ids: the requests the engine finished
    in the call, its last step's among them) that `attach` would fetch; `send(method, args)`
    sends the RPC and returns its result getter. Once per call: later ones wait for `attach`."""
    if st.early is not None:
        return
    keys = fetch_keys(st, request_ids)
    if keys:
        sent = time.monotonic()
        st.early = Early(keys, send(RPC, fetch_args(st, keys)), sent)


def drop_early(st: FrontendState, timeout: float = 5.0) -> None:
    """The call failed before `attach`: hand back what an early fetch took (its payload
    file; lent arena pieces are viewed and let go, which returns them to the worker)."""
    early, st.early = st.early, None
    if early is None:
        return
    try:
        replies = early.wait(timeout)
        merge_ranks(replies)
    except Exception:
        log.warning("vllm_hook: an early fetch's reply was not collected", exc_info=True)
        return
    release(replies)


def _fetch(st: FrontendState, keys: list[str], call: Callable[[], list], sent: float,
           rpc: Callable[..., list]) -> tuple[dict, str | None]:
    """(entries by key, None) of one fetch RPC's reply (`call` waits for it), or ({}, why it
    failed): generation succeeded, every output keeps its tokens."""
    replies = None
    try:
        replies = call()
        count_rpc(st, replies, sent)
        return merge_ranks(replies, st), None
    except Exception as e:
        log.exception("vllm_hook: fetching results from the workers failed")
        release(replies)
        try:                 # and the workers need not keep them until their TTL
            rpc(RPC, args=("discard", keys))
        except Exception:
            log.exception("vllm_hook: discarding the unfetched results failed too")
        return {}, f"results could not be fetched from the workers: {e!r}"


def attach(st: FrontendState, outputs: Sequence[Any], rpc: Callable[..., list]) -> None:
    """Fetch, in one RPC, the results of every finished output that had a spec (those an
    early fetch took, `send_early`, from its reply); attach them."""
    early, st.early = st.early, None
    todo, clean = [], []
    for out in outputs:
        if getattr(out, "finished", True):
            res = st.pop_pending(str(out.request_id))
            if res is not None:
                (clean if nothing_to_fetch(st, res) else todo).append((out, res))
    if clean:
        _attach_all(st, clean, {}, {})
    if not todo and early is None:
        if clean:
            delivered()
        return
    keys = [res.key for _, res in todo]
    # The collector stays paused from the RPC on: decoding the reply allocates an object or
    # more per request, and a full collection it triggers walks the whole heap (every output
    # of the batch): 80 ms in one fetch of 256 requests (run 61).
    with no_gc():
        t = time.perf_counter()
        fetched: dict[str, list[dict]] = {}
        failures: dict[str, str] = {}
        calls = []
        if early is not None:
            st.timing["early_fetches"] += 1
            calls.append((early.keys, lambda: early.wait(None), early.sent))
            taken = set(early.keys)
            keys = [k for k in keys if k not in taken]
        if keys:
            calls.append((keys, lambda: rpc(RPC, args=fetch_args(st, keys)), time.monotonic()))
        for ks, call, sent in calls:
            got, failure = _fetch(st, ks, call, sent, rpc)
            fetched.update(got)
            if failure is not None:
                failures.update(dict.fromkeys(ks, failure))
            st.timing["fetches"] += 1
        st.timing["fetch_rpc_s"] += time.perf_counter() - t
        faults = _minor_faults()
        _attach_all(st, todo, fetched, failures, Opened().expect(fetched))
        st.timing["read_build_page_faults"] = st.timing.get("read_build_page_faults", 0) + _minor_faults() - faults
    delivered()


def _minor_faults() -> int:
    """This process's minor page faults so far: fresh or unmapped memory in a delivery."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def delivered() -> None:
    """After a delivery: the next one's host memory readied in the background while its batch
    runs (`hostmem.Recycler.refill_soon`)."""
    RECYCLER.refill_soon()


def _attach_all(st: FrontendState, todo: list, fetched: dict, failures: dict[str, str],
                opened: Opened | None = None) -> None:
    """Each of `todo`'s (output, Resolved) its Results: from `fetched`'s entries, or its
    key's message in `failures` (its fetch failed)."""
    # The collector paused: the build copies every request's token lists, and a full
    # collection over the batch's outputs landing there stalled a batch of 256 by 0.4 to
    # 0.5 s (runs 101, 102). One thread entered once for the batch (per request: 4 µs).
    with no_gc(), one_thread():
        _attach_each(st, todo, fetched, failures, opened or Opened())


def _attach_each(st: FrontendState, todo: list, fetched: dict, failures: dict[str, str], opened: Opened) -> None:
    for out, res in todo:
        failure = failures.get(res.key)
        if failure is not None:
            setattr(out, ATTR, failed(out, failure))
            continue
        try:
            got = _results_for(st, out, fetched.get(res.key, []), res, opened, False)
            setattr(out, ATTR, got)
            if res.stack_layers and not isinstance(got, list):
                _lens_view(out, got, res.stack_layers)
        except Exception as e:    # one request's results, not the batch's
            log.exception("vllm_hook: building the results of %s failed", out.request_id)
            setattr(out, ATTR, failed(out, f"results could not be assembled: {e!r}"))


def _lens_view(out: Any, r: Results, layers: tuple[int, ...]) -> None:
    """vllm-lens's `out.activations["residual_stream"]`, `(n_layers, n_positions, hidden)`."""
    try:
        out.activations = {"residual_stream": r.stacked("resid_post", layers)}
    except (KeyError, ValueError) as e:   # rows missing: the errors say why
        out.activations = {}
        if r.ok:
            r.errors.append(f"output_residual_stream: {e}")


EAGER = sys.version_info >= (3, 12)      # tasks that start at once (`eager_start`)


class FetchBatcher:
    """Served mode: requests that finish together share one fetch RPC and one payload.

    The requests an engine step finishes are fetched as the step comes back (`prefetch`), and
    each one's generator takes its key from that batch. A request it did not cover (a stop
    string, n > 1) asks for its entries; the first opens a batch and lets the event loop run a
    few turns, in which the other requests of the same engine output (vLLM wakes them one
    after another) join it. Then one RPC fetches all their keys. Each request builds its own
    Results from the batch's entries and its shared `Opened` payload."""

    JOIN_TURNS = 4
    MAX_EARLY = 4096         # keys fetched before their request asked (`prefetch`), unclaimed
    EARLY_TTL_S = 60.0       # a request claims its key milliseconds after its step: kept 60 s
    MAX_HELD = 65536         # keys fetched while their requests decode (`hold`), unclaimed
    PRUNE_HELD = 4096        # beyond this many, those whose requests are gone are dropped

    def __init__(self, st: FrontendState, rpc: Callable[..., Any]):
        self.st, self.rpc = st, rpc          # rpc: the engine's async collective_rpc
        self._open: _Batch | None = None
        self._early: dict[str, tuple[_Batch, float]] = {}      # key -> (batch, monotonic time)
        self._held: dict[str, _Batch] = {}                      # key -> batch
        self.first_tokens = FirstTokens(st)

    def _batch(self, keys: list[str], turns: int) -> "_Batch":
        loop = asyncio.get_running_loop()
        b = _Batch(keys, loop.create_future(), Opened())
        b.done.add_done_callback(lambda f: f.cancelled() or f.exception())   # never "unretrieved"
        flush = self._flush(b, turns)
        if turns == 0 and EAGER:
            # Run up to the RPC's reply now: the fetch leaves before vLLM processes the step's
            # outputs (a scheduled task would wait for all of them, a chunk of 128 requests)
            asyncio.Task(flush, loop=loop, eager_start=True)
        else:
            loop.create_task(flush)
        return b

    def prefetch(self, request_ids: Sequence[str]) -> None:
        """The requests the engine has just finished (external ids), before vLLM processes
        their outputs (`adapters.frontend`, on the event loop): their fetch leaves now, and
        `entries` finds each key in it. A key never claimed (its client went away first)
        goes with `forget`, after EARLY_TTL_S, or once MAX_EARLY are waiting, the oldest
        first (with the last key of a batch its payload goes back to the worker)."""
        keys = fetch_keys(self.st, request_ids)
        if not keys:
            return
        self.st.timing["early_fetches"] += 1
        b, now = self._batch(keys, 0), time.monotonic()
        for k in keys:
            self._early[k] = (b, now)
        early = self._early
        while early and (len(early) > self.MAX_EARLY or now - next(iter(early.values()))[1] > self.EARLY_TTL_S):
            early.pop(next(iter(early)))

    def hold(self, request_ids: Sequence[str]) -> None:
        """Requests (external ids) that have just sampled their first token and whose results
        were complete at their prompt (`Resolved.whole_at_prefill`): fetched now, while they
        decode, not when they finish (with the batch: an RPC's round trip after its last
        step). Each key is kept until its request claims it (`entries`) or is aborted
        (`forget`); beyond MAX_HELD unclaimed, the oldest go (their requests, if any, find
        no results and say so)."""
        keys, rids = [], {}
        for rid in request_ids:
            item = self.st.pending.get(rid)
            if item is not None and not item[1].held:
                item[1].held = True
                keys.append(item[1].key)
                rids[item[1].key] = rid
        if not keys:
            return
        self.st.timing["fetched_while_running"] += len(keys)
        b, held = self._batch(keys, 0), self._held
        b.rids = rids
        for k in keys:
            held[k] = b
        if len(held) > self.PRUNE_HELD:
            # keys whose requests left without claiming them (their pending record dropped)
            pending = self.st.pending
            for k in [k for k, hb in held.items() if hb.rids.get(k) not in pending]:
                held.pop(k).built.pop(k, None)
        while len(held) > self.MAX_HELD:
            k = next(iter(held))
            held.pop(k).built.pop(k, None)

    def _build_ahead(self, b: "_Batch", merged: dict[str, list[dict]]) -> None:
        """A held batch's Results, built now (while their requests decode) for an HTTP
        response, their tokens left to set (`with_tokens`), with their inline entry data made
        ahead (`server.encode.Ready`: tokenless, stacked, as the plugin's clients read it)."""
        from ..server.encode import ON_LOOP_BELOW, READY, Ready, result_nbytes

        st, limit = self.st, self.st.cfg.max_inline_result_bytes
        # counted as ahead (`read_ahead_s`), not as the finish's read and build
        counted = st.timing["read_s"], st.timing["build_s"]
        with no_gc(), one_thread():
            for key, rid in b.rids.items():
                item = st.pending.get(rid)
                if item is None or item[1].key != key or item[1].save_dir:
                    continue
                res = item[1]
                try:
                    # prompt tokens: placeholders of the prompt's length (`build` reads only
                    # that), replaced at the finish
                    shell = _Shell(rid, [0] * res.prompt_len)
                    r = _built(st, shell, merged.get(key, []), res, b.opened, True)
                    # inline results only, and small (on the event loop: larger ones are
                    # encoded at the finish, off the loop)
                    if result_nbytes(r) <= min(limit, ON_LOOP_BELOW):
                        r.__dict__[READY] = Ready(r, True)
                    b.built[key] = r
                except Exception:        # built at the finish instead, where a failure is reported
                    log.debug("vllm_hook: building a held request's results ahead failed", exc_info=True)
        st.timing["read_s"], st.timing["build_s"] = counted

    def held(self) -> int:
        """Results fetched while their requests decode, not claimed yet (`hold`)."""
        return len(self._held)

    def forget(self, keys: Sequence[str]) -> None:
        """Aborted requests: an early fetch's results they will not claim."""
        for k in keys:
            self._early.pop(k, None)
            b = self._held.pop(k, None)
            if b is not None:
                b.built.pop(k, None)

    async def entries(self, key: str) -> tuple[list[dict], "Opened", Results | None]:
        """The entries of `key`'s request in its batch's reply, the batch's `Opened`, and the
        Results built ahead for it (`hold`; else None)."""
        b = self._held.pop(key, None)
        got = self._early.pop(key, None) if b is None else None
        b = got[0] if got is not None else b
        if b is None:
            b = self._open
            if b is None:
                b = self._open = self._batch([], self.JOIN_TURNS)
            b.keys.append(key)
        # shield: a waiter whose client went away must not cancel the others' fetch
        merged = await asyncio.shield(b.done)
        return merged.get(key, []), b.opened, b.built.pop(key, None)

    async def _flush(self, b: "_Batch", turns: int) -> None:
        for _ in range(turns):
            await asyncio.sleep(0)
        if self._open is b:
            self._open = None
        t, sent = time.perf_counter(), time.monotonic()
        replies = None
        try:
            replies = await self.rpc(RPC, args=fetch_args(self.st, b.keys, running=bool(b.rids)))
            count_rpc(self.st, replies, sent)
            merged = merge_ranks(replies, self.st)
            b.opened.expect(merged)
        except Exception as e:
            release(replies)
            try:             # the workers need not keep them until their TTL
                await self.rpc(RPC, args=("discard", b.keys))
            except Exception:
                log.exception("vllm_hook: discarding the unfetched results failed too")
            b.done.set_exception(e)
            return
        finally:
            self.st.timing["fetch_rpc_s"] += time.perf_counter() - t
            self.st.timing["fetches"] += 1
        if b.rids:                   # held: built ahead
            t1 = time.perf_counter()
            try:
                self._build_ahead(b, merged)
            except Exception:    # read and built at the finish instead, a failure reported there
                log.debug("vllm_hook: reading a held batch ahead failed", exc_info=True)
            self.st.timing["read_ahead_s"] += time.perf_counter() - t1
        b.done.set_result(merged)


class FirstTokens:
    """Requests whose results are complete at their prompt, until their first token comes
    back (`FetchBatcher.hold` then fetches them). They are noted at admission with their
    engine request, whose id vLLM completes only after admission (an internal suffix)."""

    MAX = 4096

    def __init__(self, st: FrontendState):
        self.st = st
        # (engine request, external id); a deque: 0.33 admits on a thread beside the loop
        self._new: deque[tuple[Any, str]] = deque()
        self._by_id: dict[str, str] = {}            # engine id -> external id

    def add(self, request: Any, request_id: str) -> None:
        self._new.append((request, request_id))

    def __bool__(self) -> bool:
        return bool(self._new or self._by_id)

    def watching(self, id_of: Callable[[Any], str | None]) -> dict[str, str]:
        """Engine id -> external id of every watched request (`id_of`: an engine request's
        id, None while vLLM has not assigned it); the caller pops each as its first token
        comes back."""
        by_id = self._by_id
        if self._new:
            new = self._new
            for _ in range(len(new)):
                request, rid = new.popleft()
                eid = id_of(request)
                if eid is not None:
                    by_id[eid] = rid
                elif len(new) < self.MAX or rid in self.st.pending:
                    new.append((request, rid))    # admitted on another thread, its id not yet assigned
            if len(by_id) > self.MAX:        # aborted before their first token
                pending = self.st.pending
                for eid in [e for e, rid in by_id.items() if rid not in pending]:
                    del by_id[eid]
        return by_id


def with_tokens(r: Results | None, view: Any) -> Results | None:
    """`r`, built ahead (`FetchBatcher.hold`), given the finished request's tokens (`view`:
    its output's request id, prompt and generated token ids); None where they do not fit."""
    outs = list(getattr(view, "outputs", None) or ())
    prompt = view.prompt_token_ids or []
    if r is None or len(outs) != 1 or r.prompt_len != len(prompt) or r.request_id != str(view.request_id):
        return None
    r.token_ids = [*prompt, *outs[0].token_ids]
    return r


@dataclass
class _Shell:
    """What `_built` reads of an output, before the request's finish."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: tuple = ()


@dataclass
class _Batch:
    keys: list[str]
    done: asyncio.Future
    opened: Opened
    rids: dict = field(default_factory=dict)       # held: key -> request id
    built: dict = field(default_factory=dict)      # held: key -> Results built ahead


def failed(output: Any, message: str) -> Results | list[Results]:
    """What a request whose results were lost carries instead: its tokens and the error."""
    rs = _of_tokens(output, errors=[message])
    return rs[0] if len(rs) == 1 else rs


def forget(st: FrontendState, request_ids: Sequence[str]) -> list[str]:
    """Aborted requests: drop their frontend records; return the keys whose worker-side results
    must be discarded. Accepts external ids and internal ones (`{external}-{8 chars}`)."""
    keys = []
    for rid in request_ids:
        res = st.pop_pending(str(rid))
        if res is None and "-" in str(rid):
            res = st.pop_pending(str(rid).rsplit("-", 1)[0])
        if res is not None:
            keys.append(res.key)
    return keys
