"""Input records of an extraction job: lines of a JSONL file or rows of a saved Hugging Face
dataset (`datasets.Dataset.save_to_disk`), read lazily, each checked on its own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1)
    content: str


class InputRow(BaseModel):
    """One input: a prompt, a chat conversation (rendered with the model's chat template), or
    token ids. Other fields (an id, a label) are ignored and may be kept for joining afterwards."""

    model_config = ConfigDict(extra="ignore")
    prompt: str | None = None
    messages: list[Message] | None = None
    prompt_token_ids: list[StrictInt] | None = None

    @field_validator("prompt")
    @classmethod
    def _nonempty(cls, v):
        if v is not None and not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("messages", "prompt_token_ids")
    @classmethod
    def _some(cls, v):
        if v is not None and not v:
            raise ValueError("the list is empty")
        return v


@dataclass(frozen=True)
class Record:
    """Input `index` (0-based; for JSONL the line number minus one), its prompt or messages,
    or why it cannot be used."""

    index: int
    label: str
    prompt: str | None = None
    messages: list[dict] | None = None
    token_ids: list[int] | None = None
    error: str | None = None


def _record(index: int, label: str, obj: Any) -> Record:
    if not isinstance(obj, dict):
        return Record(index, label, error=f"expected a JSON object, got {type(obj).__name__}")
    try:
        row = InputRow.model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        return Record(index, label, error=f"{where}: {first['msg']}")
    if sum(x is not None for x in (row.prompt, row.messages, row.prompt_token_ids)) != 1:
        return Record(index, label, error='give exactly one of "prompt" (a string), "messages" '
                                          '(a list of {"role", "content"}) or "prompt_token_ids"')
    msgs = [m.model_dump() for m in row.messages] if row.messages is not None else None
    return Record(index, label, prompt=row.prompt, messages=msgs, token_ids=row.prompt_token_ids)


class Source:
    """An input file or dataset directory: `len(source)` records, `source.records(start)`."""

    def __init__(self, path: str | Path, split: str | None = None):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"input {self.path} does not exist")
        self.kind: Literal["jsonl", "dataset"] = "dataset" if self.path.is_dir() else "jsonl"
        self._ds = _open_dataset(self.path, split) if self.kind == "dataset" else None

    def __len__(self) -> int:
        if self._ds is not None:
            return len(self._ds)
        with open(self.path, "rb") as f:
            return sum(1 for _ in f)

    def records(self, start: int = 0) -> Iterator[Record]:
        """Records from input index `start` on. JSONL lines that are blank are skipped."""
        if self._ds is not None:
            for i, row in enumerate(self._ds.select(range(start, len(self._ds))), start):
                yield _record(i, f"row {i}", row)
            return
        import json

        with open(self.path, "rb") as f:
            for i, raw in enumerate(f):
                if i < start or not raw.strip():
                    continue
                label = f"line {i + 1}"
                try:
                    obj = json.loads(raw)
                except (ValueError, RecursionError) as e:
                    yield Record(i, label, error=f"not valid JSON ({str(e)[:120]})")
                    continue
                yield _record(i, label, obj)


def _open_dataset(path: Path, split: str | None):
    try:
        import datasets
    except ImportError as e:
        raise RuntimeError(f"{path} is a directory: reading a saved Hugging Face dataset needs "
                           "`pip install datasets` (or give a JSONL file)") from e
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            if len(ds) != 1:
                raise ValueError(f"{path} holds splits {sorted(ds)}: pass --split")
            split = next(iter(ds))
        if split not in ds:
            raise ValueError(f"{path} has no split {split!r} (it has {sorted(ds)})")
        ds = ds[split]
    if not {"prompt", "messages", "prompt_token_ids"} & set(ds.column_names):
        raise ValueError(f"{path}: the dataset needs a 'prompt', 'messages' or 'prompt_token_ids' "
                         f"column (it has {ds.column_names})")
    return ds
