"""Python hooks: user code inside the forward pass, per request (`Hook`), or for every
request until cleared (persistent hooks, `api.register_hooks`). See docs/hooks.md."""

from .context import BatchHookContext, HookContext
from .hook import Hook
from .registry import operator_hook

__all__ = ["BatchHookContext", "Hook", "HookContext", "operator_hook"]
