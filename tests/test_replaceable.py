"""Linears an MXLinear cannot stand in for: found, kept in float, and named in errors.

Mamba's and Jamba's mixers multiply by `dt_proj.weight` themselves (`self.dt_proj.weight @ x`); PhiMoE's router is
an `nn.Linear` whose forward pass returns the top experts with the logits. The end-to-end cases (Mamba and PhiMoE
models calibrated and reloaded) are in `test_families.py`."""

import logging

import pytest
import torch
from torch import nn

from optimum_dmx import DMXConfig, DMXQuantizer, MXLinear
from optimum_dmx.nn import linear_modules_to_quantize
from optimum_dmx.nn.replaceable import NOT_A_LINEAR_FORWARD, NOT_REACHED, USED_OUTSIDE_FORWARD, linears_kept_in_float
from optimum_dmx.nn.rotation import rotate_model
from optimum_dmx.nn.transforms import TransformedLinear

from .helpers import tiny_llama, word_tokenizer, words


class _Router(nn.Linear):
    """A linear whose forward pass returns more than its output (as PhiMoE's and Llama 4's routers do)."""

    def forward(self, x):
        logits = super().forward(x)
        return logits, logits.topk(2, dim=-1).indices


class _SumsInOtherOrder(nn.Linear):
    """A linear map computed otherwise (as Falcon's `FalconLinear` does): an MXLinear stands in for it."""

    def forward(self, x):
        return x @ self.weight.T + self.bias


class _Block(nn.Module):
    """`used` runs as a module; `direct` is multiplied by its weight and bias by hand; `dtype_read` runs as a module,
    and its weight's dtype is read outside it; `unreached` never runs (as a vision encoder's linears on text);
    `router` is not a linear map; `falcon` is one."""

    def __init__(self):
        super().__init__()
        self.used, self.direct, self.dtype_read, self.unreached = (nn.Linear(8, 8) for _ in range(4))
        self.router, self.falcon = _Router(8, 8), _SumsInOtherOrder(8, 8)

    def forward(self, x):
        x = self.falcon(self.used(x))
        x = x @ self.direct.weight.T + self.direct.bias
        logits, _ = self.router(x)
        return self.dtype_read(logits.to(self.dtype_read.weight.dtype))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, input_ids, use_cache=False):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return x


def test_the_linears_calibration_must_leave_in_float_are_found_and_only_those():
    model = _Model()
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    found = linears_kept_in_float(model, torch.tensor([[1, 2, 3]]), names)
    assert found == {
        f"blocks.{i}.{name}": reason
        for i in range(2)
        for name, reason in [
            ("direct", USED_OUTSIDE_FORWARD),
            ("dtype_read", USED_OUTSIDE_FORWARD),
            ("router", NOT_A_LINEAR_FORWARD),
            ("unreached", NOT_REACHED),
        ]
    }
    assert linears_kept_in_float(model, torch.tensor([[1, 2, 3]]), ["blocks.0.used", "blocks.1.unreached"]) == {
        "blocks.1.unreached": NOT_REACHED
    }
    # the probe leaves no hook behind
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_the_layers_of_a_rotation_made_before_quantizing_are_replaceable():
    """A model rotated by the caller (`rotate_model`) holds `TransformedLinear`s: their forward pass is `F.linear` of
    the transformed input, which an MXLinear built from them computes too."""
    model = tiny_llama(seed=0)
    names = list(linear_modules_to_quantize(model, ["lm_head"]))
    rotate_model(model, "online_block_hadamard", names)
    assert all(isinstance(model.get_submodule(name), TransformedLinear) for name in names)
    assert linears_kept_in_float(model, torch.tensor([[1, 2, 3, 4]]), names) == {}


def test_an_mx_linear_says_why_it_has_no_weight():
    module = MXLinear.from_linear(nn.Linear(32, 8), "mxfp6_e2m3")
    with pytest.raises(AttributeError, match=r"MXLinear has no weight: it stores it packed in mxfp6_e2m3.*"):
        module.weight  # noqa: B018
    assert not hasattr(module, "weight")  # hasattr answers as for any missing attribute
    with pytest.raises(AttributeError, match="no_such_thing"):
        module.no_such_thing  # noqa: B018


def _direct_read_llama():
    """A tiny Llama whose first MLP multiplies by `down_proj`'s weight itself, as Mamba's mixer does with `dt_proj`."""
    model = tiny_llama(seed=0)
    mlp = model.model.layers[0].mlp
    mlp.forward = lambda x: (mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)) @ mlp.down_proj.weight.T
    return model


CALIBRATION = dict(steps=4, seq_len=16, batch_size=2, num_samples=8)


def test_calibration_keeps_a_directly_read_linear_in_float_and_says_so(caplog):
    model = _direct_read_llama()
    texts = [words(7 * i, 40) for i in range(20)]
    config = DMXConfig(target_bits=5, dataset=texts, tokenizer=word_tokenizer(), **CALIBRATION)
    with caplog.at_level(logging.WARNING, logger="optimum_dmx.integration.hf_quantizer"):
        DMXQuantizer(config).quantize_model(model)
    assert (
        "has 1 linear(s) that a quantized layer cannot stand in for (the model uses its weight outside its forward "
        "pass: mlp.down_proj)" in caplog.text
    )
    recorded = model.config.quantization_config
    assert "model.layers.0.mlp.down_proj" in recorded.modules_to_not_convert
    assert "model.layers.0.mlp.down_proj" not in recorded.format_map
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert isinstance(model.model.layers[1].mlp.down_proj, MXLinear)  # the same linear elsewhere is quantized
    assert len(recorded.format_map) == 2 * 7 - 1
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]))


def test_a_given_map_naming_a_directly_read_linear_is_refused():
    model = _direct_read_llama()
    names = [n for n, m in model.model.layers.named_modules() if isinstance(m, nn.Linear)]
    format_map = {f"model.layers.{n}": "mxfp8_e4m3" for n in names}
    texts = [words(7 * i, 40) for i in range(20)]
    config = DMXConfig(
        format_map=format_map, weight_rounding="gptq", dataset=texts, tokenizer=word_tokenizer(), **CALIBRATION
    )
    with pytest.raises(
        ValueError,
        match=r"format_map names 'model.layers.0.mlp.down_proj', which a quantized layer cannot stand in for "
        r"\(the model uses its weight outside",
    ):
        DMXQuantizer(config).quantize_model(model)
