"""`ctx.final_norm` computes vLLM's RMSNorm / GemmaRMSNorm in plain torch ops (the module's
own call costs about 200 µs of host time per call through vLLM's op dispatch): the same
values as the module, in fp32 and bf16."""

import pytest
import torch

from vllm_hook.adapters.params import _direct_rms_norm


@pytest.mark.parametrize("cls_name", ["RMSNorm", "GemmaRMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_norm_equals_the_module(cls_name, dtype):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import layernorm

    with set_current_vllm_config(VllmConfig()):
        norm = getattr(layernorm, cls_name)(64, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64) * 0.3 + (0.0 if cls_name == "GemmaRMSNorm" else 1.0))
        norm = norm.to(dtype)
        h = (torch.randn(5, 64) * 3).to(dtype)
        want = norm.forward_native(h)
    fast = _direct_rms_norm(norm)
    assert fast is not None
    got = fast(h)
    assert got.dtype == want.dtype
    assert torch.allclose(got.float(), want.float(), rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-2)
    assert _direct_rms_norm(torch.nn.LayerNorm(64)) is None      # other norms: the module's call


def test_another_stages_parameter_is_named():
    """With pipeline parallelism vLLM holds other stages' modules as PPMissingLayer: a hook
    asking for their parameters learns whose they are."""
    from vllm_hook.adapters.params import ModelAccess

    class PPMissingLayer(torch.nn.Identity):
        pass

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([PPMissingLayer(), torch.nn.Linear(4, 4)])
    model.model.norm = PPMissingLayer()
    access = ModelAccess(model)
    assert access("model.layers.1.weight").shape == (4, 4)
    for name in ("model.layers.0.weight", "model.norm.weight"):
        with pytest.raises(KeyError, match="another pipeline stage's"):
            access(name)
    with pytest.raises(KeyError, match="has no parameter"):
        access("model.layers.1.bias_x")
    assert access.norm_elsewhere
    with pytest.raises(AttributeError, match="last pipeline stage's"):
        access.final_norm(torch.zeros(1, 4))
    # Stage 0 holds the embedding; lm_head is the last stage's unless the two are tied.
    model.model.embed_tokens = torch.nn.Embedding(8, 4)
    model.lm_head = PPMissingLayer()
    for tied in (False, True):
        model.config = type("Config", (), {"tie_word_embeddings": tied})()
        access = ModelAccess(model)
        if tied:
            assert access("lm_head.weight").data_ptr() == model.model.embed_tokens.weight.data_ptr()
        else:
            with pytest.raises(KeyError, match="another pipeline stage's"):
                access("lm_head.weight")
        # prefetch gathers this stage's names and leaves the others' to them
        assert access.prefetch(["model.layers.1.weight", "model.norm.weight", "lm_head.weight"]) == (
            ["lm_head.weight", "model.layers.1.weight"] if tied else ["model.layers.1.weight"])
