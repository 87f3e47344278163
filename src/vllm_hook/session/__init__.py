"""Model objects researchers port from: steering sessions (chatspace-style: `SteerModel` over
`vllm.LLM`, `AsyncSteerModel` over `vllm.AsyncLLM`) and `HookLLM` (vLLM-Hook / MIA style)."""

from .chat import MessageBoundary, chat_prompt
from .hookllm import HookLLM
from .model import AsyncSteerModel, ChatResponse, SteerModel, SteerResponse
from .state import SteeringState

__all__ = ["AsyncSteerModel", "ChatResponse", "HookLLM", "MessageBoundary", "SteerModel", "SteerResponse",
           "SteeringState", "chat_prompt"]
