"""Model parameters and modules for hooks (`ctx.get_parameter`, `ctx.final_norm`): vLLM's
module tree read here, gathered over tensor-parallel ranks, vocabulary padding removed."""

from __future__ import annotations


import torch

from ..hooks import kernels

# Names that vLLM may hold under another one (tied embeddings share one tensor).
_ALIASES = {"lm_head.weight": ("model.embed_tokens.weight",)}


class ModelAccess:
    def __init__(self, model: torch.nn.Module, tp_rank: int = 0, tp_size: int = 1):
        self.model, self.tp_rank, self.tp_size = model, tp_rank, tp_size
        self._cache: dict[str, torch.Tensor] = {}
        self._norm = getattr(getattr(model, "model", None), "norm", None)
        # With pipeline parallelism the final norm is the last stage's.
        self.norm_elsewhere = type(self._norm).__name__ == "PPMissingLayer"
        if self.norm_elsewhere:
            self._norm = None
        self._fast_norm = _direct_rms_norm(self._norm)

    def __call__(self, name: str) -> torch.Tensor:
        t = self._cache.get(name)
        if t is None:
            t = self._cache[name] = self._gather(name)
        return t

    def prefetch(self, names: list[str]) -> list[str]:
        """Gather `names` now (those of other pipeline stages are theirs to gather)."""
        for n in names:
            if not self._other_stage(n) or self._tied(n):
                self(n)
        return sorted(self._cache)

    def _find(self, name: str) -> tuple[str, torch.nn.Parameter]:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        if name in params:
            return name, params[name]
        if self._other_stage(name) and not self._tied(name):
            raise KeyError(f"parameter {name!r} is another pipeline stage's: a hook reads the parameters "
                           "of the stage that holds its hook point (e.g. lm_head and model.norm are the "
                           "last stage's)")
        for cand in _ALIASES.get(name, ()):
            if cand in params:
                return cand, params[cand]
        near = sorted(n for n in params if n.split(".")[-1] == name.split(".")[-1])[:8]
        raise KeyError(f"the model has no parameter {name!r} (vLLM's names; e.g. {near or sorted(params)[:8]})")

    def _tied(self, name: str) -> bool:
        """Whether `name` is another name of a tensor this stage holds (tied embeddings)."""
        config = getattr(self.model, "config", None)
        return name in _ALIASES and bool(getattr(config, "tie_word_embeddings", False))

    def _other_stage(self, name: str) -> bool:
        """Whether a module on `name`'s path is a placeholder for another stage's."""
        mod = self.model
        for part in name.split(".")[:-1]:
            mod = getattr(mod, part, None)
            if mod is None:
                return False
            if type(mod).__name__ == "PPMissingLayer":
                return True
        return False

    def _gather(self, name: str) -> torch.Tensor:
        found, p = self._find(name)
        t = p.detach()
        if self.tp_size > 1:
            dim = getattr(p, "output_dim", None)
            dim = getattr(p, "input_dim", None) if dim is None else dim
            if dim is not None:
                from vllm.distributed import tensor_model_parallel_all_gather

                t = tensor_model_parallel_all_gather(t.contiguous(), dim=dim)
        owner = self.model.get_submodule(found.rsplit(".", 1)[0]) if "." in found else self.model
        vocab = getattr(owner, "org_vocab_size", None)
        if vocab is not None and t.shape[0] > vocab:
            t = t[:vocab]                      # vLLM pads the vocabulary; the checkpoint does not
        return t

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The model's own final norm applied to `h` (what the unembedding reads)."""
        if self._norm is None:
            raise AttributeError(f"{type(self.model).__name__} has no model.norm on this worker"
                                 + (" (it is the last pipeline stage's)" if self.norm_elsewhere else ""))
        if self._fast_norm is not None:
            return self._fast_norm(h)
        out = self._norm(h)
        return out[0] if isinstance(out, tuple) else out


def _direct_rms_norm(norm):
    """vLLM's RMSNorm / GemmaRMSNorm math, or None for other norms: one Triton kernel on a
    GPU (`hooks/kernels.py`), plain torch ops otherwise. Called through the module, vLLM's op
    dispatch cost about 200 µs of host time per call on the H200 host (the logit lens calls it
    once per step)."""
    name = type(norm).__name__
    if name not in ("RMSNorm", "GemmaRMSNorm") or getattr(norm, "variance_size_override", None) is not None:
        return None
    eps = getattr(norm, "variance_epsilon", None)
    weight = getattr(norm, "weight", None)
    if not isinstance(eps, float) or not isinstance(weight, torch.Tensor):
        return None
    if name == "RMSNorm" and not getattr(norm, "has_weight", True):
        weight = None
    gemma = name == "GemmaRMSNorm"
    cached: dict = {}

    def apply(h: torch.Tensor) -> torch.Tensor:
        w = cached.get("w")
        if w is None and weight is not None:     # Gemma scales by (1 + w), in fp32
            w = cached["w"] = weight.detach().float() + 1.0 if gemma else weight.detach()
        if w is not None and h.dim() == 2:
            out = kernels.rms_norm(h, w, eps)     # one kernel on a GPU
            if out is not None:
                return out
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
        if w is not None:
            x = x.to(w.dtype) * w
        return x.to(h.dtype)

    return apply
