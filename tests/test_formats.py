"""Exact MX formats: constants, bit-exactness against torchao, special values, packing, properties, errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from optimum_dmx.formats import (
    E8M0_NAN,
    MX_FORMATS,
    cast,
    get_format,
    pack_mx,
    packed_shapes,
    packing,
    quantize_mx,
    unpack_mx,
)
from optimum_dmx.formats import blocks as mx_blocks

from .helpers import adversarial_blocks, assert_bitwise_equal, wide_range

torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
torchao_constants = pytest.importorskip("torchao.prototype.mx_formats.constants")

TORCHAO_DTYPES = {
    "mxfp8_e4m3": torch.float8_e4m3fn,
    "mxfp6_e3m2": torchao_constants.DTYPE_FP6_E3M2,
    "mxfp6_e2m3": torchao_constants.DTYPE_FP6_E2M3,
    "mxfp4_e2m1": torch.float4_e2m1fn_x2,
}
FORMAT_NAMES = list(TORCHAO_DTYPES)


def torchao_quantize(x: torch.Tensor, name: str) -> torch.Tensor:
    """Independent reference: torchao's OCP MX cast (FLOOR scale) and back, in the input's dtype."""
    scale, data = torchao_mx.to_mx(x.contiguous(), TORCHAO_DTYPES[name], 32)
    return torchao_mx.to_dtype(data, scale, TORCHAO_DTYPES[name], 32, x.dtype)


# --- the format table ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, ebits, mbits, bias, emax, max_normal, min_normal, min_subnormal, bits",
    [
        ("mxfp8_e4m3", 4, 3, 7, 8, 448.0, 2.0**-6, 2.0**-9, 8),
        ("mxfp6_e3m2", 3, 2, 3, 4, 28.0, 0.25, 0.0625, 6),
        ("mxfp6_e2m3", 2, 3, 1, 2, 7.5, 1.0, 0.125, 6),
        ("mxfp4_e2m1", 2, 1, 1, 2, 6.0, 1.0, 0.5, 4),
    ],
)
def test_format_constants(name, ebits, mbits, bias, emax, max_normal, min_normal, min_subnormal, bits):
    fmt = MX_FORMATS[name]
    assert (fmt.name, fmt.ebits, fmt.mbits, fmt.bias, fmt.emax) == (name, ebits, mbits, bias, emax)
    assert (fmt.max_normal, fmt.min_normal, fmt.min_subnormal, fmt.bits) == (
        max_normal,
        min_normal,
        min_subnormal,
        bits,
    )
    assert fmt.storage_bits() == bits + 0.25


def test_aliases_resolve_and_table_lists_canonical_names():
    assert list(MX_FORMATS) == ["mxfp8_e4m3", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1"]
    assert MX_FORMATS["mxfp8"] is MX_FORMATS["mxfp8_e4m3"]
    assert get_format("mxfp6") is MX_FORMATS["mxfp6_e2m3"]
    assert get_format("mxfp4") is get_format(MX_FORMATS["mxfp4_e2m1"])
    assert "mxfp4" in MX_FORMATS and "mxfp5" not in MX_FORMATS


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_code_table_holds_exactly_the_format_grid(name):
    fmt = MX_FORMATS[name]
    values = packing.code_values(fmt)
    positive = values[: 2 ** (fmt.bits - 1)]
    if name == "mxfp8_e4m3":  # the all-ones code is NaN, never produced by saturating quantization
        positive = positive[:-1]
    assert positive[0] == 0 and positive.max() == fmt.max_normal
    assert positive[1] == fmt.min_subnormal and bool((positive[1:] > positive[:-1]).all())
    # every grid value quantizes to itself in a block whose maximum is the format's largest normal
    blocks = torch.zeros(len(positive), 32)
    blocks[:, 0], blocks[:, 1] = positive, fmt.max_normal
    assert_bitwise_equal(quantize_mx(blocks, fmt), blocks)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_grid_value_gets_back_its_own_code_negative_zero_included(name):
    """`element_codes` inverts the code table for every code but E4M3's NaN, both signs of every value (-0.0 has the
    sign bit): from the bit pattern and by comparisons, eagerly and compiled."""
    fmt = MX_FORMATS[name]
    codes = torch.arange(2**fmt.bits)
    if name == "mxfp8_e4m3":
        codes = codes[(codes & 0x7F) != 0x7F]
    values = packing.code_values(fmt)[codes]
    negative_zero = values[codes == 2 ** (fmt.bits - 1)]
    assert torch.signbit(negative_zero).all() and (negative_zero == 0).all()
    for from_bits in (True, False):
        assert torch.equal(packing.element_codes(values, fmt, from_bits), codes.float()), from_bits
    compiled = torch.compile(packing.element_codes, backend="inductor", fullgraph=True, dynamic=False)
    assert torch.equal(compiled(values.repeat(64, 1), fmt, False), codes.float().repeat(64, 1))


# --- bit-exactness against torchao --------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torchao_on_wide_dynamic_range(name, dtype):
    x = wide_range((64, 2048), seed=FORMAT_NAMES.index(name), dtype=dtype, decades=12)
    assert_bitwise_equal(quantize_mx(x, name), torchao_quantize(x, name))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_float16_input_matches_float32_reference_cast_back(name):
    x = wide_range((16, 256), seed=1, decades=3).half()
    assert_bitwise_equal(quantize_mx(x, name), torchao_quantize(x.float(), name).half())


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_matches_torchao_on_adversarial_values(name):
    x = adversarial_blocks(MX_FORMATS[name])
    # row by row too: a tensor whose largest block nears 2^128 takes the bit-pattern path for all its blocks
    for batch in [x, *x.split(1)]:
        assert_bitwise_equal(quantize_mx(batch, name), torchao_quantize(batch, name))
        assert_bitwise_equal(quantize_mx(batch.bfloat16(), name), torchao_quantize(batch.bfloat16(), name))


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp6_e3m2", "mxfp6_e2m3"])
def test_float8_carrier_and_bit_pattern_rounding_agree(name):
    fmt = MX_FORMATS[name]
    assert cast.float8_carrier(fmt) is not None
    blocks = mx_blocks.to_blocks(wide_range((64, 1024), seed=21, decades=12), 32)
    elements, k, shift = cast.quantize_blocks(blocks, fmt)
    by_bits = cast.round_elements(blocks * mx_blocks.block_scale(-k), fmt)
    assert_bitwise_equal(elements * 2.0**shift, by_bits)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_rounding_by_grid_lookup_equals_rounding_on_the_bit_pattern(name):
    """`ElementGrid.round` (GPTQ's per-column rounding) gives `round_elements`'s bits: every tie (half to even),
    the floats on either side of it, both zeros, subnormals, saturation, and values over many binades."""
    fmt = MX_FORMATS[name]
    grid = packing.ElementGrid.of(fmt)
    values = packing.code_values(fmt)[: 2 ** (fmt.bits - 1)]
    values = values[values <= fmt.max_normal]
    ties = (values[:-1] + values[1:]) / 2
    near_ties = torch.cat([ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])
    edges = torch.tensor([0.0, fmt.max_normal * 1.01, fmt.max_normal * 3, 2.0**20, 2.0**-130, fmt.min_subnormal / 3])
    magnitudes = torch.cat([values, near_ties, edges, wide_range((4, 1024), seed=5, decades=3).abs().flatten()])
    v = torch.cat([magnitudes, -magnitudes])
    assert_bitwise_equal(grid.round(v), cast.round_elements(v.clone(), fmt))
    assert bool((grid.round(ties) != ties).all())  # the midpoints are ties, each rounded to one side


def spec_quantize_block(values: list[float], fmt) -> list[float]:
    """Scalar float64 transcription of the OCP MX conversion: the reference for blocks whose scale exponent
    clamps at -127 or that hold fp32 subnormals, where torchao 0.18 departs from the specification."""
    if any(math.isnan(v) or math.isinf(v) for v in values):
        return [math.nan] * len(values)
    amax = max(abs(v) for v in values)
    k = -127 if amax == 0 else min(max(math.frexp(amax)[1] - 1 - fmt.emax, -127), 127)
    out = []
    for v in values:
        scaled = abs(v) / 2.0**k
        exponent = max(math.frexp(scaled)[1] - 1, fmt.emin) if scaled else fmt.emin
        step = 2.0 ** (exponent - fmt.mbits)
        out.append(math.copysign(min(round(scaled / step) * step, fmt.max_normal) * 2.0**k, v))
    return out


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_bottom_of_the_scale_range_follows_the_specification(name):
    fmt = MX_FORMATS[name]
    rows = [
        [2.0**-120, 2.0**-121 * 3, -(2.0**-125), 2.0**-126],  # scale exponent clamped at -127
        [2.0**-140, -(2.0**-135), 2.0**-149, 2.0**-127, 0.0, 3 * 2.0**-130],
        [1e-40, 5e-41, -7e-42, 2.0**-126 * 0.75],
        [2.0**-126, 2.0**-127 * 1.5, 2.0**-149 * 3],
    ]
    for row in rows:
        x = torch.tensor(row)
        expected = torch.tensor(spec_quantize_block(x.tolist(), fmt))
        assert_bitwise_equal(quantize_mx(x, fmt), expected)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_spec_transcription_agrees_with_torchao_on_normal_data(name):
    """Checks the scalar reference itself, so the subnormal test above compares against something sound."""
    x = wide_range((4, 64), seed=17, decades=6)
    expected = torch.tensor([spec_quantize_block(block, MX_FORMATS[name]) for block in x.reshape(-1, 32).tolist()])
    assert_bitwise_equal(torchao_quantize(x, name), expected.reshape(4, 64))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_ties_round_half_to_even(name):
    fmt = MX_FORMATS[name]
    grid = packing.code_values(fmt)[1 : 2 ** (fmt.bits - 1) - (name == "mxfp8_e4m3")]
    ties = (grid[:-1] + grid[1:]) / 2
    blocks = torch.zeros(len(ties), 32)
    blocks[:, 0], blocks[:, 1] = ties, 2.0**fmt.emax  # one tie per block, block scale 1
    out = quantize_mx(blocks, fmt)[:, 0]
    codes_of = {v: code for code, v in enumerate(grid.tolist(), start=1)}
    even_neighbour = [lo if codes_of[lo] % 2 == 0 else hi for lo, hi in zip(grid[:-1].tolist(), grid[1:].tolist())]
    assert out.tolist() == even_neighbour


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_saturates_to_max_normal(name):
    fmt = MX_FORMATS[name]
    # the block max 1.99 * 2^emax keeps scale 1 but lies above max normal
    x = torch.tensor([1.99 * 2.0**fmt.emax, -1.99 * 2.0**fmt.emax, fmt.max_normal * 1.01] + [0.0] * 29)
    assert quantize_mx(x, fmt)[:3].tolist() == [fmt.max_normal, -fmt.max_normal, fmt.max_normal]


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_zero_block_stays_zero_with_its_sign(name):
    x = torch.tensor([0.0, -0.0] * 16)
    assert_bitwise_equal(quantize_mx(x, name), x)
    assert pack_mx(x, name).scales.tolist() == [0]


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_poisons_only_its_own_block(name, bad):
    x = wide_range((2, 64), seed=3, decades=1)
    x[0, 5] = bad
    out = quantize_mx(x, name)
    assert torch.isnan(out[0, :32]).all()
    assert_bitwise_equal(out[:, 32:], quantize_mx(x[:, 32:].contiguous(), name))
    assert_bitwise_equal(out[1], quantize_mx(x[1], name))
    packed = pack_mx(x, name)
    assert packed.scales[0, 0] == E8M0_NAN
    assert torch.isnan(unpack_mx(packed)[0, :32]).all()
    if math.isnan(bad):  # torchao 0.18 keeps Inf blocks partly finite; NaN handling matches the spec
        assert_bitwise_equal(out, torchao_quantize(x, name))


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("last_dim", [1, 17, 31, 33, 100])
def test_last_dim_not_multiple_of_block_is_zero_padded(name, last_dim):
    x = wide_range((3, 128), seed=last_dim, decades=2)[:, :last_dim].contiguous()
    padded = torch.nn.functional.pad(x, (0, -last_dim % 32))
    expected = torchao_quantize(padded, name)[:, :last_dim]
    assert_bitwise_equal(quantize_mx(x, name), expected)


@pytest.mark.parametrize("shape", [(64,), (2, 3, 64), (4, 1, 2, 96)])
def test_any_leading_shape(shape):
    x = wide_range((*shape[:-1], shape[-1]), seed=5, decades=2)
    out = quantize_mx(x, "mxfp4")
    assert out.shape == x.shape
    assert_bitwise_equal(out.reshape(-1, shape[-1]), quantize_mx(x.reshape(-1, shape[-1]), "mxfp4"))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_other_block_sizes_use_their_own_scales(name):
    x = wide_range((8, 64), seed=9, decades=3)
    blocked = quantize_mx(x.reshape(8, 4, 16), name, block_size=16)
    assert_bitwise_equal(quantize_mx(x, name, block_size=16), blocked.reshape(8, 64))


# --- packing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("last_dim", [64, 45])
def test_unpack_of_pack_equals_quantize_bit_for_bit(name, dtype, last_dim):
    x = wide_range((6, 64), seed=11, dtype=torch.float32, decades=4 if dtype != torch.float16 else 2)
    x = x[:, :last_dim].to(dtype).contiguous()
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-3, -7.0], dtype=dtype)
    packed = pack_mx(x, name)
    assert packed.codes.dtype == torch.uint8 and packed.scales.dtype == torch.uint8
    assert (packed.codes.shape, packed.scales.shape) == packed_shapes(x.shape, name)
    assert_bitwise_equal(unpack_mx(packed, dtype), quantize_mx(x, name))


@pytest.mark.parametrize(
    "name, bytes_per_row", [("mxfp8_e4m3", 64), ("mxfp6_e3m2", 48), ("mxfp6_e2m3", 48), ("mxfp4_e2m1", 32)]
)
def test_packed_sizes(name, bytes_per_row):
    packed = pack_mx(torch.randn(5, 64), name)
    assert packed.codes.shape == (5, bytes_per_row) and packed.scales.shape == (5, 2)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_codes_and_scales_match_torchao_encoding(name):
    """Element codes are the raw bit patterns torchao uses; FP4 puts the even element in the low nibble."""
    x = wide_range((8, 128), seed=13, decades=3)
    scale, data = torchao_mx.to_mx(x, TORCHAO_DTYPES[name], 32)
    packed = pack_mx(x, name)
    assert torch.equal(packed.scales, scale.view(torch.uint8))
    fmt = MX_FORMATS[name]
    if fmt.bits == 6:  # torchao keeps FP6 codes one per byte; ours are four codes in three bytes
        assert torch.equal(packing.unpack_codes(packed.codes, 6), data.view(torch.uint8).long())
    else:
        assert torch.equal(packed.codes, data.view(torch.uint8))


def test_fp6_packs_four_codes_little_endian_into_three_bytes():
    codes = torch.tensor([[0b000001, 0b100000, 0b111111, 0b010101]])
    word = 0b000001 | 0b100000 << 6 | 0b111111 << 12 | 0b010101 << 18
    assert packing.pack_codes(codes, 6).tolist() == [[word & 0xFF, (word >> 8) & 0xFF, word >> 16]]
    assert packing.unpack_codes(packing.pack_codes(codes, 6), 6).tolist() == codes.tolist()


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_negating_packed_rows_equals_packing_the_negated_rows(name):
    """`negate_rows` flips the sign bits of some rows' codes: the codes of those rows negated, scales unchanged."""
    x = wide_range((6, 64), seed=17, decades=3)
    x[0, :2] = torch.tensor([0.0, 1e-30])  # a zero and a value that rounds to zero keep their codes' sign rule
    rows = torch.tensor([True, False, True, True, False, False])
    negated = torch.where(rows[:, None], -x, x)
    packed = pack_mx(x, name)
    assert torch.equal(packing.negate_rows(packed.codes, name, rows), pack_mx(negated, name).codes)
    assert torch.equal(packed.scales, pack_mx(negated, name).scales)


def test_unpack_rejects_mismatched_shapes():
    packed = pack_mx(torch.randn(4, 64), "mxfp4")
    packed.codes = packed.codes[:, :-1]
    with pytest.raises(ValueError, match=r"needs codes \(4, 32\)"):
        unpack_mx(packed)


# --- properties ---------------------------------------------------------------------------------------

finite_floats = st.floats(min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, width=32)
blocks_strategy = st.lists(finite_floats, min_size=1, max_size=70)


@settings(max_examples=150, deadline=None)
@given(values=blocks_strategy, name=st.sampled_from(FORMAT_NAMES))
def test_idempotent(values, name):
    once = quantize_mx(torch.tensor(values), name)
    assert_bitwise_equal(quantize_mx(once, name), once)


@settings(max_examples=150, deadline=None)
@given(values=blocks_strategy, name=st.sampled_from(FORMAT_NAMES))
def test_sign_symmetric(values, name):
    x = torch.tensor(values)
    assert_bitwise_equal(quantize_mx(-x, name), -quantize_mx(x, name))


@settings(max_examples=150, deadline=None)
@given(values=st.lists(finite_floats, min_size=2, max_size=32), name=st.sampled_from(FORMAT_NAMES))
def test_monotone_within_a_block(values, name):
    x = torch.tensor(values).sort().values
    out = quantize_mx(x, name)
    assert bool((out[1:] >= out[:-1]).all())


@settings(max_examples=100, deadline=None)
@given(values=blocks_strategy, name=st.sampled_from(FORMAT_NAMES))
def test_error_bounded_by_half_a_step_below_saturation(values, name):
    fmt = MX_FORMATS[name]
    x = torch.tensor(values)
    out = quantize_mx(x, name)
    blocks = mx_blocks.to_blocks(x, 32)
    scale = torch.exp2(
        (mx_blocks.block_max_exponent(mx_blocks.block_max(blocks))[0] - fmt.emax).clamp(-127, 127).double()
    )
    scaled = (blocks.double() / scale).reshape(-1)[: len(values)]
    step = torch.exp2(torch.floor(torch.log2(scaled.abs().clamp_min(1e-300))).clamp_min(fmt.emin) - fmt.mbits)
    in_range = scaled.abs() <= fmt.max_normal
    err = (out.double() / scale.reshape(-1, 1).expand(-1, 32).reshape(-1)[: len(values)] - scaled).abs()
    assert bool((err[in_range] <= step[in_range] / 2).all())


# --- bad input ----------------------------------------------------------------------------------------


def test_unknown_format_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"Unknown MX format 'mxfp5'.*mxfp8_e4m3.*mxfp4"):
        quantize_mx(torch.randn(32), "mxfp5")


@pytest.mark.parametrize("block_size", [0, -32, 3.5, "32", True])
def test_bad_block_size(block_size):
    with pytest.raises(ValueError, match=rf"block_size must be a positive integer.*{block_size!r}"):
        quantize_mx(torch.randn(32), "mxfp4", block_size=block_size)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.float64])
def test_non_float_tensors_rejected(dtype):
    with pytest.raises(TypeError, match=rf"got dtype {dtype}"):
        quantize_mx(torch.ones(32, dtype=dtype), "mxfp8")
    with pytest.raises(TypeError, match=rf"got dtype {dtype}"):
        pack_mx(torch.ones(32, dtype=dtype), "mxfp8")


def test_non_tensor_and_scalar_rejected():
    with pytest.raises(TypeError, match="got list"):
        quantize_mx([1.0, 2.0], "mxfp8")
    with pytest.raises(ValueError, match="0-dim"):
        quantize_mx(torch.tensor(1.0), "mxfp8")
