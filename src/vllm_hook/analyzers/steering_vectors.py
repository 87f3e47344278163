"""Contrastive steering vectors: instruction following (Stolfo et al., ICLR 2025) and output
language, as in IBM vLLM-Hook's activation-steering demos.

The method, in our words: put each base query behind the instruction and without it; the
difference of the two prompts' residual streams at the last prompt token, averaged over the
queries and normalised, is the instruction's direction u at that layer. `avg_proj` is the
mean projection of the with-instruction streams on u. Steering then either sets every
selected row's projection on u to `avg_proj` (`adjust_rs`: h <- h + (avg_proj - h.u) u, our
`cap` op with min = max = avg_proj) or adds `coefficient` x u (`add_vector`, our `add`).

    d = contrastive_direction(llm, with_ids, without_ids, layer=8)
    spec = {"steer": steer_ops(d, method="adjust_rs")}

`layer` is the decoder layer whose output (resid_post) is read and steered, 0-based. The
vectors mean something only on a trained instruction-following model: on the tiny random
model of the tests they are arbitrary directions, and the tests check only that the engine
computes what Hugging Face computes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file


@dataclass
class Direction:
    """A unit steering direction at `layer` and the mean projection of the examples that
    carry the instruction."""

    vector: torch.Tensor        # [hidden], unit norm, float32
    avg_proj: float
    layer: int

    def save(self, path: str | Path) -> None:
        save_file({"vector": self.vector.contiguous()}, str(path),
                  metadata={"avg_proj": repr(self.avg_proj), "layer": str(self.layer)})

    @classmethod
    def load(cls, path: str | Path) -> "Direction":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        return cls(load_file(str(path))["vector"], float(meta["avg_proj"]), int(meta["layer"]))


class SteeringConfig(BaseModel):
    """How a direction is applied (the fields of MIA's steering configs, in our terms)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["adjust_rs", "add_vector"] = "adjust_rs"
    layer: int = Field(description="decoder layer whose output is read and steered, 0-based")
    coefficient: float = Field(default=1.0, description="add_vector's scale (adjust_rs ignores it)")
    positions: Literal["all_tokens", "last_token"] = Field(
        default="all_tokens", description="last_token: the last prompt token and every generated token")

    @classmethod
    def load(cls, path: str | Path) -> "SteeringConfig":
        return cls.model_validate(json.loads(Path(path).read_text()))


def last_token_streams(llm, prompts: Sequence[list[int]], layer: int) -> torch.Tensor:
    """[n, hidden] float32: the residual stream after `layer` at each prompt's last token."""
    from vllm import SamplingParams

    import vllm_hook

    spec = {"capture": [{"layers": [layer], "tokens": "last_prompt"}]}
    sp = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"vllm_hook": spec})
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
    return torch.stack([vllm_hook.results(o).activations["resid_post"][layer][-1] for o in outs]).float()


def direction_from_streams(with_h: torch.Tensor, without_h: torch.Tensor, layer: int) -> Direction:
    """u = mean(with - without) / its norm; avg_proj = mean(with . u)."""
    if with_h.shape != without_h.shape or with_h.dim() != 2 or not len(with_h):
        raise ValueError(f"expected two [n, hidden] tensors of one shape, got {tuple(with_h.shape)} "
                         f"and {tuple(without_h.shape)}")
    diff = (with_h.double() - without_h.double()).mean(0)
    norm = float(diff.norm())
    if not norm > 0:
        raise ValueError("the two prompt sets give the same mean stream: no direction")
    u = diff / norm
    return Direction(u.float(), float((with_h.double() @ u).mean()), layer)


def contrastive_direction(llm, with_instruction: Sequence[list[int]], without: Sequence[list[int]],
                          layer: int) -> Direction:
    """The direction of what the instruction changes at `layer`, from paired prompts (token
    ids; pair i is the same query with and without it)."""
    if len(with_instruction) != len(without):
        raise ValueError(f"{len(with_instruction)} prompts with the instruction, {len(without)} without: pair them")
    h = last_token_streams(llm, [*with_instruction, *without], layer)
    n = len(with_instruction)
    return direction_from_streams(h[:n], h[n:], layer)


def steer_ops(d: Direction, method: str = "adjust_rs", coefficient: float = 1.0,
              positions: str = "all_tokens", layer: int | None = None) -> list[dict]:
    """The spec's steering ops for `d` (a SteeringConfig's fields). adjust_rs needs the layer
    in the engine's `projection_layers`; add_vector runs at every layer."""
    cfg = SteeringConfig(method=method, layer=d.layer if layer is None else layer,
                         coefficient=coefficient, positions=positions)
    tokens = ["all"] if cfg.positions == "all_tokens" else ["last_prompt", "generated"]
    v = d.vector.tolist()
    if cfg.method == "adjust_rs":
        return [{"op": "cap", "layer": cfg.layer, "vector": v, "min": d.avg_proj, "max": d.avg_proj, "tokens": t}
                for t in tokens]
    return [{"op": "add", "layer": cfg.layer, "vector": v, "scale": cfg.coefficient, "tokens": t} for t in tokens]


def steer_ops_from_config(d: Direction, cfg: SteeringConfig) -> list[dict]:
    return steer_ops(d, cfg.method, cfg.coefficient, cfg.positions, cfg.layer)
