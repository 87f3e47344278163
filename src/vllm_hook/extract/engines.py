"""Where an extraction job's requests run: an offline `vllm.LLM`, or a `vllm serve` over HTTP.

Both take a batch of records and give, per record, its `Results` (whose `errors` say what
could not be captured) or why it was refused (an input vLLM or the plugin did not admit). A failure of the engine itself (a dead server) raises: the
rows written so far stay, and `--resume` continues.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..adapters.frontend import input_errors
from ..results import Results, results
from .inputs import Record

Outcome = Results | str        # a record's results, or why it was refused


class OfflineEngine:
    """Records through `llm.generate`, a batch per call (vLLM batches them continuously)."""

    def __init__(self, llm: Any):
        self.llm = llm
        self._tok = None

    def _input(self, rec: Record) -> dict:
        if rec.prompt is not None:
            return {"prompt": rec.prompt}
        if rec.token_ids is not None:
            return {"prompt_token_ids": rec.token_ids}
        if self._tok is None:
            self._tok = self.llm.get_tokenizer()
        # As vLLM's chat does: the template adds any special tokens, tokenizing must not.
        text = self._tok.apply_chat_template(rec.messages, tokenize=False, add_generation_prompt=True)
        return {"prompt_token_ids": self._tok(text, add_special_tokens=False)["input_ids"]}

    def run(self, records: list[Record], spec: dict, max_tokens: int) -> list[Outcome]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={"vllm_hook": spec})
        out: list[Outcome] = []
        inputs, todo = [], []
        for i, rec in enumerate(records):
            try:
                inputs.append(self._input(rec))
                todo.append(i)
                out.append("")
            except Exception as e:          # a conversation the chat template refuses
                out.append(f"the chat template failed: {e}")
        for i, g in zip(todo, self._generate(inputs, params)):
            out[i] = g if isinstance(g, str) else results(g, strict=False)
        return out

    def _generate(self, inputs: list[dict], params) -> list:
        if not inputs:
            return []
        try:
            return self.llm.generate(inputs, params, use_tqdm=False)
        except input_errors() as e:         # SpecError too; vLLM's own input checks
            if len(inputs) == 1:
                return [str(e)]
            # vLLM refuses a whole call for one bad prompt: halve until it is found
            mid = len(inputs) // 2
            return self._generate(inputs[:mid], params) + self._generate(inputs[mid:], params)

    def close(self) -> None:
        pass


class ServedEngine:
    """Records as concurrent requests to a `vllm serve` with vllm-hook (`--server URL`)."""

    def __init__(self, url: str, *, api_key: str | None = None, model: str | None = None,
                 concurrency: int = 64):
        from ..client import AsyncClient

        self._loop = asyncio.new_event_loop()
        self._client = AsyncClient(url, api_key=api_key, model=model)
        self._sem = asyncio.Semaphore(concurrency)
        self.model = self._loop.run_until_complete(self._client._model())

    async def _one(self, rec: Record, spec: dict, max_tokens: int) -> Outcome:
        from ..client import ServerError

        async with self._sem:
            try:
                if rec.prompt is not None or rec.token_ids is not None:
                    gen = await self._client.generate(rec.prompt if rec.prompt is not None else rec.token_ids,
                                                      spec, max_tokens=max_tokens, temperature=0)
                else:
                    gen = await self._client.chat(rec.messages, spec, max_tokens=max_tokens, temperature=0)
            except ServerError as e:
                if 400 <= e.status < 500 and e.status not in (401, 403, 429):
                    return e.message        # this input was refused
                raise
        if gen.results is None:
            return "the server returned no vllm_hook results (is the plugin installed there?)"
        return gen.results

    def run(self, records: list[Record], spec: dict, max_tokens: int) -> list[Outcome]:
        async def batch():
            got = await asyncio.gather(*(self._one(r, spec, max_tokens) for r in records))
            # this loop runs only inside run(): the batch's files released now, not at the next
            await self._client.release_pending()
            return got
        return list(self._loop.run_until_complete(batch()))

    def close(self) -> None:
        self._loop.run_until_complete(self._client.aclose())
        self._loop.close()
