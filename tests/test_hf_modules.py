"""MXLinear: packed storage, forward semantics, weight cache; model surgery errors."""

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from optimum_dmx import MXLinear, quantize_mx
from optimum_dmx.formats import packed_shapes
from optimum_dmx.nn import InputCache, replace_with_mx_linear

from .helpers import linear_names, tiny_llama

FORMATS = ["mxfp4_e2m1", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3"]


def _linear(in_features, out_features, bias=True, dtype=torch.float32):
    torch.manual_seed(1)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_features", [64, 48, 70])
def test_forward_is_quantized_activation_times_quantized_weight(fmt, in_features):
    linear = _linear(in_features, 24)
    module = MXLinear.from_linear(linear, fmt)
    x = torch.randn(3, 5, in_features)
    expected = F.linear(quantize_mx(x, fmt), quantize_mx(linear.weight.detach(), fmt), linear.bias)
    torch.testing.assert_close(module(x), expected, rtol=0, atol=0)
    codes, scales = packed_shapes((24, in_features), fmt)
    assert module.weight_packed.dtype == torch.uint8 and module.weight_packed.shape == codes
    assert module.weight_scale.dtype == torch.uint8 and module.weight_scale.shape == scales
    assert set(module.state_dict()) == {"weight_packed", "weight_scale", "bias"}


def test_weight_only_mode_leaves_activations_unquantized():
    linear = _linear(64, 16, bias=False)
    module = MXLinear.from_linear(linear, "mxfp4", quantize_activations=False)
    x = torch.randn(2, 64)
    torch.testing.assert_close(module(x), x @ quantize_mx(linear.weight.detach(), "mxfp4").T, rtol=0, atol=0)


def test_packed_only_mode_matches_cached_mode_and_keeps_no_cache():
    module = MXLinear.from_linear(_linear(96, 32), "mxfp6")
    x = torch.randn(4, 96)
    cached = module(x)
    module.cache_weight = False
    assert torch.equal(module(x), cached)
    assert module._weight_cache is None


def test_computes_in_the_input_dtype():
    linear = _linear(64, 16, dtype=torch.bfloat16)
    module = MXLinear.from_linear(linear, "mxfp8")
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    out = module(x)
    assert out.dtype == torch.bfloat16
    expected = F.linear(quantize_mx(x, "mxfp8"), quantize_mx(linear.weight.detach(), "mxfp8"), linear.bias)
    assert torch.equal(out, expected)


def test_cache_follows_new_packed_tensors():
    source = MXLinear.from_linear(_linear(64, 8, bias=False), "mxfp4")
    target = MXLinear(64, 8, bias=False, fmt="mxfp4")
    x = torch.randn(2, 64)
    stale = target(x)  # caches the all-zero weight
    target.load_state_dict(source.state_dict())
    assert not torch.equal(target(x), stale)
    assert torch.equal(target(x), source(x))
    with torch.no_grad():
        target.weight_scale.add_(1)  # in place: every block scale doubles
    assert torch.equal(target(x), 2 * source(x))


def test_meta_linear_gives_empty_meta_module():
    with torch.device("meta"):
        linear = nn.Linear(80, 16)
    module = MXLinear.from_linear(linear, "mxfp6_e3m2")
    assert module.weight_packed.is_meta and module.weight_packed.shape == packed_shapes((16, 80), "mxfp6_e3m2")[0]


def _tiny():
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))


def test_replace_names_a_missing_module():
    with pytest.raises(ValueError, match=r"'5'.*does not have"):
        replace_with_mx_linear(_tiny(), {"5": "mxfp4"})


def test_replace_names_a_module_that_is_not_linear():
    with pytest.raises(ValueError, match=r"'1', a ReLU"):
        replace_with_mx_linear(_tiny(), {"1": "mxfp4"})


def test_replace_refuses_an_already_quantized_module():
    model = replace_with_mx_linear(_tiny(), {"0": "mxfp4"})
    with pytest.raises(ValueError, match=r"'0' is already an MXLinear"):
        replace_with_mx_linear(model, {"0": "mxfp8"})


def test_module_built_in_inference_mode_runs():
    linear = _linear(64, 8)
    with torch.inference_mode():
        module = MXLinear.from_linear(linear, "mxfp8")
        x = torch.randn(2, 64)
        expected = F.linear(quantize_mx(x, "mxfp8"), quantize_mx(linear.weight, "mxfp8"), linear.bias)
        assert torch.equal(module(x), expected)
        assert torch.equal(module(x), expected)  # the weight cache built under inference mode is reused


def _shared_pair(fmt_a: str, fmt_b: str) -> tuple[MXLinear, MXLinear]:
    a, b = MXLinear.from_linear(_linear(64, 16), fmt_a), MXLinear.from_linear(_linear(64, 8), fmt_b)
    a.input_casts = b.input_casts = InputCache()
    return a, b


def test_linears_reading_one_input_in_one_format_quantize_it_once():
    a, b = _shared_pair("mxfp6_e2m3", "mxfp6_e2m3")
    x = torch.randn(3, 64)
    cast = a.matmul_input(x)
    assert b.matmul_input(x) is cast and len(a.input_casts) == 1
    assert torch.equal(cast, quantize_mx(x, "mxfp6_e2m3"))
    other = torch.randn(3, 64)
    assert b.matmul_input(other) is not cast and len(a.input_casts) == 2


def test_shared_input_casts_follow_format_and_in_place_changes():
    a, b = _shared_pair("mxfp4", "mxfp8")
    x = torch.randn(2, 64)
    assert torch.equal(b.matmul_input(x), quantize_mx(x, "mxfp8"))
    assert torch.equal(a.matmul_input(x), quantize_mx(x, "mxfp4"))  # another format: its own cast
    x.mul_(3.0)  # modified in place: the cached casts are stale
    assert torch.equal(a.matmul_input(x), quantize_mx(x, "mxfp4"))
    assert torch.equal(b(x), MXLinear.from_linear(_linear(64, 8), "mxfp8")(x))


def test_shared_input_casts_do_not_outlive_their_inputs():
    model = tiny_llama()
    names = linear_names(model)
    replace_with_mx_linear(model, {name: "mxfp6_e2m3" if "mlp" in name else "mxfp8" for name in names})
    cache = model.get_submodule(names[0]).input_casts
    assert all(model.get_submodule(name).input_casts is cache for name in names)
    seen = []
    model.model.layers[0].self_attn.v_proj.register_forward_pre_hook(lambda module, args: seen.append(len(cache)))
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        shared = model(ids).logits
        assert seen == [1]  # q/k/v: one cast of their common input
        assert len(cache) == 0  # every input freed, and its casts with it
        for name in names:
            model.get_submodule(name).input_casts = None
        assert torch.equal(model(ids).logits, shared)  # sharing changes no bit


def test_a_copied_model_gets_its_own_empty_input_cache():
    model = tiny_llama()
    names = linear_names(model)
    replace_with_mx_linear(model, {name: "mxfp4" for name in names})
    cache = model.get_submodule(names[0]).input_casts
    x = torch.randn(2, 64)
    keep = model.get_submodule(names[0]).matmul_input(x)
    copied = copy.deepcopy(model)
    copied_cache = copied.get_submodule(names[0]).input_casts
    assert copied_cache is not cache and len(copied_cache) == 0 and len(cache) == 1
    assert all(copied.get_submodule(name).input_casts is copied_cache for name in names)
    restored = pickle.loads(pickle.dumps(model))
    assert len(restored.get_submodule(names[0]).input_casts) == 0
    assert torch.equal(keep, quantize_mx(x, "mxfp4"))
