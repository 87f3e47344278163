"""Activation datasets: `vllm-hook extract` writes them, `vllm_hook.load_dataset` reads them.

Flow: inputs.py (records) -> engines.py (offline LLM or served) -> run.py (the loop, rows per
record) -> shards.py (safetensors shards + manifest.json) -> dataset.py (reading back).
"""

from .dataset import ActivationDataset, load_dataset
from .engines import OfflineEngine, ServedEngine
from .job import Job, Manifest
from .run import BadInput, extract

__all__ = ["ActivationDataset", "BadInput", "Job", "Manifest", "OfflineEngine", "ServedEngine",
           "extract", "load_dataset"]
