"""Errors a user sees. Each says where in the spec the problem is and how to fix it."""

from __future__ import annotations


class SpecError(ValueError):
    """An invalid request spec. Raised before the request is queued (HTTP 400 when served)."""

    def __init__(self, where: str, problem: str, fix: str):
        self.where, self.problem, self.fix = where, problem, fix
        super().__init__(f"vllm_hook spec error at {where}: {problem}. Fix: {fix}.")

    def at_prompt(self, index: int) -> "SpecError":
        """The same error, naming the prompt of a batch it belongs to."""
        err = type(self)(f"prompts[{index}].{self.where}", self.problem,
                         f"{self.fix} (like vLLM for bad sampling parameters, no prompt of this "
                         "call was run)")
        return err


class UnknownVectorError(SpecError):
    """A steering op names a vector nobody registered (HTTP 404 when served)."""


class HookRuntimeError(RuntimeError):
    """Captures or steering of a request could not be completed; the message says why."""
