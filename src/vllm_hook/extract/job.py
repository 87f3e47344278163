"""What an extraction job asks for, the request spec it becomes, and its manifest."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import __version__
from ..spec.schema import HookSpec

MANIFEST = "manifest.json"
FORMAT = "vllm-hook-activations/1"
DTYPES = ("float32", "bfloat16", "float16", "model")
# Sites with one row per token (attn_scores rows have the prompt's length: no fixed shape).
EXTRACT_SITES = ("resid_post", "resid_pre", "attn_out", "mlp_out", "q", "k")


class Job(BaseModel):
    """The options that define a dataset: a resumed run must give the same ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str
    input: str
    split: str | None = None
    site: Literal["resid_post", "resid_pre", "attn_out", "mlp_out", "q", "k"] = "resid_post"
    layers: list[int] | Literal["all"] = "all"
    tokens: str | list[int] = "all"
    dtype: Literal["float32", "bfloat16", "float16", "model"] = "float32"
    max_tokens: int = Field(default=1, ge=1)
    steer: list[dict] | None = None
    shard_rows: int = Field(default=65536, ge=1)

    def spec(self) -> dict:
        """The request spec of every record (validated by the engine at the first request)."""
        spec = {"capture": [{"layers": self.layers, "site": self.site, "tokens": self.tokens}],
                "dtype": "float32" if self.dtype == "float32" else "model"}
        if self.steer:
            spec["steer"] = self.steer
        HookSpec.model_validate(spec)
        return spec


def steer_from_file(path: str | None) -> list[dict] | None:
    """The steering ops of a spec file: a JSON list of ops, or an object with "steer"."""
    if path is None:
        return None
    data = json.loads(Path(path).read_text())
    ops = data.get("steer") if isinstance(data, dict) else data
    if not isinstance(ops, list) or (isinstance(data, dict) and set(data) - {"steer"}):
        raise ValueError(f"{path}: expected a JSON list of steering ops or {{\"steer\": [...]}} "
                         "(capture comes from --layers/--site/--tokens)")
    HookSpec.model_validate({"steer": ops})
    return ops


class Shard(BaseModel):
    file: str
    rows: int
    records: tuple[int, int]        # input indices [first, end) the shard covers


class Failure(BaseModel):
    record: int                     # input index
    where: str                      # "line 12" / "row 11"
    error: str


class Manifest(BaseModel):
    """`manifest.json`: the job, the shards written and the inputs that failed. Rewritten
    atomically after each shard, so it always describes complete files only."""

    model_config = ConfigDict(extra="forbid")
    format: str = FORMAT
    vllm_hook_version: str = __version__
    job: Job
    layers: list[int] = Field(default_factory=list)   # resolved layer indices
    columns: dict[str, list] = Field(default_factory=dict)   # name -> [dtype, row shape]
    shards: list[Shard] = Field(default_factory=list)
    records_done: int = 0           # inputs before this index are in shards or in failures
    records_total: int | None = None
    failures: list[Failure] = Field(default_factory=list)
    tokens_processed: int = 0
    complete: bool = False

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @classmethod
    def load(cls, out_dir: str | Path) -> "Manifest":
        path = Path(out_dir) / MANIFEST
        try:
            return cls.model_validate_json(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{out_dir} has no {MANIFEST}: not a vllm-hook activation dataset") from None
        except ValidationError as e:
            raise ValueError(f"{path} is not a valid vllm-hook manifest: {e.errors()[0]['msg']}") from None

    def save(self, out_dir: str | Path) -> None:
        path = Path(out_dir) / MANIFEST
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.model_dump_json(indent=1))
        os.replace(tmp, path)
