"""vLLM `general_plugins` entry point: runs once in every vLLM process.

Idempotent and cheap: it only registers patches that apply when vLLM imports the patched
modules (frontend pieces in the frontend, runner pieces in workers). It touches no CUDA.
`VLLM_HOOK_DISABLE=1` makes it a complete no-op.
"""

from __future__ import annotations

from .config import disabled

_registered = False


def register() -> None:
    global _registered
    if _registered or disabled():
        return
    _registered = True
    from .adapters import install

    install()
