"""Layer discovery refuses what it does not know, by name (no engine)."""

import pytest
import torch

from vllm_hook.adapters.model import MLP_NAMES, InstrumentError, child, find_layers


class _Encoder(torch.nn.Module):        # no model.layers anywhere
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])


def test_an_unknown_model_is_refused_with_its_name():
    with pytest.raises(InstrumentError, match="_Encoder"):
        find_layers(_Encoder())


def test_moe_blocks_are_mlp_out():
    layer = torch.nn.Module()
    layer.block_sparse_moe = torch.nn.Linear(2, 2)          # vLLM's Mixtral decoder layer
    assert child(layer, MLP_NAMES, "mlp_out") is layer.block_sparse_moe
    with pytest.raises(InstrumentError, match="mlp_out submodule of Module"):
        child(torch.nn.Module(), MLP_NAMES, "mlp_out")
