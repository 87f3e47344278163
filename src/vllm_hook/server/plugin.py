"""`vllm.endpoint_plugins` entry point (`VLLM_PLUGINS=vllm_hook,vllm_hook_routes`).

Not needed with an unset VLLM_PLUGINS: the general plugin already attaches the routes. It
exists for deployments that allowlist plugins; attaching twice is a no-op.
"""

from __future__ import annotations

from ..config import disabled


class HookRoutes:
    name = "vllm_hook_routes"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        if disabled():
            return
        from .routes import attach

        attach(app)

    async def init_state(self, engine_client, state, args) -> None:
        return None


def make_plugin() -> HookRoutes:
    return HookRoutes()
