"""Layer discovery refuses what it does not know, by name (no engine)."""

import pytest
import torch

from vllm_hook.model.instrument import InstrumentError, _child, _MLP_NAMES, find_layers


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
    assert _child(layer, _MLP_NAMES, "mlp_out") is layer.block_sparse_moe
    with pytest.raises(InstrumentError, match="mlp_out submodule of Module"):
        _child(torch.nn.Module(), _MLP_NAMES, "mlp_out")
