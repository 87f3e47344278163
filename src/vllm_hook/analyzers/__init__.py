"""Analyzers: turn one request's `Results` into a typed answer (see docs/analyzers.md).

    from vllm_hook import analyzers
    tracker = analyzers.get("attention_tracker")("tracker-config.json")
    spec = {"capture": [tracker.capture_spec()]}
    ...
    verdict = tracker.analyze(vllm_hook.results(out), spans=prompt.spans)
"""

from ._base import Analyzer, AnalyzerConfig
from ._registry import available, get, register
from .prompt import BuiltPrompt, build_prompt
from .attnlink import AttnLink, AttnLinkConfig, AttnLinkResult, link_prompt
from .attention_tracker import (AttentionTracker, AttentionTrackerConfig, AttentionTrackerResult,
                                HeadSelection, find_important_heads, focus_map)
from .core_reranker import CoreReranker, CoreRerankerConfig, RerankPrompt, RerankResult
from .emotion_tracker import EmotionDirections, EmotionTrace, EmotionTracker, EmotionTrackerConfig, fit_directions
from .hidden_state_probe import (HiddenStateProbe, HiddenStateProbeConfig, LinearProbe, ProbeResult,
                                 fit_probe, probe_features)

__all__ = [
    "Analyzer", "AnalyzerConfig", "AttnLink", "AttnLinkConfig", "AttnLinkResult", "link_prompt", "AttentionTracker", "AttentionTrackerConfig", "AttentionTrackerResult",
    "BuiltPrompt", "CoreReranker", "EmotionDirections", "EmotionTrace", "EmotionTracker", "EmotionTrackerConfig",
    "fit_directions", "CoreRerankerConfig", "HeadSelection", "HiddenStateProbe",
    "HiddenStateProbeConfig", "LinearProbe", "ProbeResult", "RerankPrompt", "RerankResult", "available",
    "build_prompt", "find_important_heads", "fit_probe", "focus_map", "get", "probe_features", "register",
]
