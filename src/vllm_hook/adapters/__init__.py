"""The only code that reads vLLM internals: one adapter per model runner."""

from __future__ import annotations


def install() -> None:
    from . import frontend, server, v1, v2
    from .common import worker_rpc
    from .patching import when_imported

    frontend.install()
    server.install()
    v1.install()
    v2.install()

    def _add_rpc(mod):
        if not hasattr(mod.WorkerBase, "vllm_hook_call"):
            mod.WorkerBase.vllm_hook_call = worker_rpc

    when_imported("vllm.v1.worker.worker_base", _add_rpc)
