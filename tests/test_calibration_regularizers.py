import math

import pytest
import torch

from optimum_dmx.calibration.regularizers import bit_regularizer, simple_regularizer, target_regularizer
from optimum_dmx.nn.bits import average_bits, bit_summary, storage_bits, tensor_sizes

SHAPES = [(64, 64), (32, 64), (128, 64), (64, 128)]


def test_tensor_sizes_count_weights_and_activation_features():
    assert tensor_sizes(SHAPES).tolist() == [64 * 64 + 64, 32 * 64 + 64, 128 * 64 + 64, 64 * 128 + 128]
    assert tensor_sizes(SHAPES, quantize_activations=False).tolist() == [64 * 64, 32 * 64, 128 * 64, 64 * 128]


def test_simple_and_weighted_averages():
    bits = torch.tensor([4.0, 8.0, 4.0, 6.0])
    assert average_bits(bits, "simple").item() == pytest.approx(5.5)
    sizes = tensor_sizes(SHAPES)
    expected = sum(b * n for b, n in zip(bits.tolist(), sizes.tolist())) / sizes.sum().item()
    assert average_bits(bits, "weighted", sizes).item() == pytest.approx(expected)
    assert expected != pytest.approx(5.5)


def test_weighted_average_needs_sizes_and_unknown_kind_is_named():
    with pytest.raises(ValueError, match="sizes"):
        average_bits(torch.ones(2), "weighted")
    with pytest.raises(ValueError, match="'median'.*simple, weighted"):
        average_bits(torch.ones(2), "median")


def test_average_gradients():
    bits = torch.tensor([4.0, 8.0, 4.0, 6.0], requires_grad=True)
    average_bits(bits, "simple").backward()
    torch.testing.assert_close(bits.grad, torch.full((4,), 0.25))
    bits.grad = None
    sizes = tensor_sizes(SHAPES)
    average_bits(bits, "weighted", sizes).backward()
    torch.testing.assert_close(bits.grad, (sizes / sizes.sum()).float())


def test_storage_bits_include_e8m0_scales():
    assert storage_bits([4.0], [(16, 64)]) == pytest.approx(4.25)
    assert storage_bits([8.0, 4.0], [(10, 32), (10, 32)]) == pytest.approx(6.25)
    # A row of 40 elements is stored as two padded blocks: 64 codes of 4 bits and two scales, over 40 elements.
    assert storage_bits([4], [(3, 40)]) == pytest.approx((64 * 4 + 16) / 40)
    # FP6 packs four codes in three bytes; 40 -> 64 padded codes -> 48 bytes per row.
    assert storage_bits([6], [(2, 40)]) == pytest.approx((48 * 8 + 16) / 40)
    with pytest.raises(ValueError, match="2 bit widths for 1 weights"):
        storage_bits([4.0, 8.0], [(3, 40)])


def test_bit_summary_reports_all_three_numbers():
    summary = bit_summary([4, 8, 4, 6], SHAPES)
    sizes = tensor_sizes(SHAPES)
    assert summary["bits_simple"] == pytest.approx(5.5)
    assert summary["bits_weighted"] == pytest.approx(
        average_bits(torch.tensor([4.0, 8, 4, 6]), "weighted", sizes).item()
    )
    numel = sum(o * i for o, i in SHAPES)
    weight_bits = sum(b * o * i for b, (o, i) in zip([4, 8, 4, 6], SHAPES))
    assert summary["storage_bits"] == pytest.approx((weight_bits + 8 * numel / 32) / numel)


def test_target_regularizer_values_and_gradient():
    below = torch.tensor(4.8, requires_grad=True)
    assert target_regularizer(below, 5.0, 5.0).item() == 0.0
    target_regularizer(below, 5.0, 5.0).backward()
    assert below.grad.item() == 0.0
    above = torch.tensor(5.4, requires_grad=True)
    value = target_regularizer(above, 5.0, 5.0)
    assert value.item() == pytest.approx(2.0)
    value.backward()
    assert above.grad.item() == pytest.approx(5.0)


def test_simple_regularizer_values_and_gradient():
    bits = torch.tensor(4.5, requires_grad=True)
    value = simple_regularizer(bits, 5.0)
    assert value.item() == pytest.approx(22.5)
    value.backward()
    assert bits.grad.item() == pytest.approx(5.0)


def test_bit_regularizer_dispatch():
    bits = torch.tensor(6.0)
    assert bit_regularizer(bits, "target", 2.0, 5.0).item() == pytest.approx(2.0)
    assert bit_regularizer(bits, "simple", 2.0, 5.0).item() == pytest.approx(12.0)
    with pytest.raises(ValueError, match="'l2'.*target, simple"):
        bit_regularizer(bits, "l2", 2.0, 5.0)


def test_regularizer_gradient_reaches_beta_through_bits():
    # bits = 4 + 2 beta for the MXFP8 pair: d R_t / d beta = 2 lambda above the target.
    beta = torch.tensor([1.0, 0.5], requires_grad=True)
    bits = 4 + 2 * beta
    bit_regularizer(average_bits(bits, "simple"), "target", 5.0, 5.0).backward()
    torch.testing.assert_close(beta.grad, torch.tensor([5.0, 5.0]))
    assert math.isfinite(beta.grad.sum().item())
