"""Steering sessions (chatspace-style): `SteerModel` over `vllm.LLM`, `AsyncSteerModel` over
`vllm.AsyncLLM`."""

from .chat import MessageBoundary, chat_prompt
from .model import AsyncSteerModel, ChatResponse, SteerModel, SteerResponse
from .state import SteeringState

__all__ = ["AsyncSteerModel", "ChatResponse", "MessageBoundary", "SteerModel", "SteerResponse",
           "SteeringState", "chat_prompt"]
