"""Block-scale rules: the OCP floor and the loaders' rounding rules, bit-exact against the loaders' own code."""

import pytest
import torch
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

from optimum_dmx.formats import MX_FORMATS, SCALE_RULES, pack_mx, quantize_mx
from optimum_dmx.formats.spec import scale_rounding_bits

# compressed-tensors serves these three formats; it names them by element bits.
CT_FORMATS = {"mxfp4_e2m1": 4, "mxfp6_e2m3": 6, "mxfp8_e4m3": 8}


def blocks_with_edge_maxima(dtype: torch.dtype) -> torch.Tensor:
    """Gaussian blocks over six decades, plus blocks whose maximum sits just below, at and above every rounding
    threshold `2 - 2^-(r+1)` (r = 1, 2, 3) in `dtype`."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    edges = []
    for r in (1, 2, 3):
        threshold = torch.tensor(2 - 2.0 ** -(r + 1), dtype=dtype)
        below = torch.nextafter(threshold, torch.tensor(0.0, dtype=dtype))
        above = torch.nextafter(threshold, torch.tensor(4.0, dtype=dtype))
        edges += [below, threshold, above]
    rows = torch.rand(len(edges), 32, generator=g) * 0.5
    rows[:, 7] = torch.stack(edges).float() * torch.tensor([-1.0, 1.0]).repeat(len(edges))[: len(edges)]
    rows = rows * 2.0 ** torch.arange(len(edges)).unsqueeze(1).sub(4)
    rows = torch.nn.functional.pad(rows, (0, 256 - 32))
    return torch.cat([x, rows]).to(dtype)


@pytest.mark.parametrize("fmt, bits", CT_FORMATS.items())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed_tensors_rule_matches_generate_mx_scales(fmt, bits, dtype):
    x = blocks_with_edge_maxima(dtype)
    amax = x.reshape(x.shape[0], -1, 32).abs().amax(-1)
    expected = generate_mx_scales(amax, bits).to(torch.uint8)
    assert torch.equal(pack_mx(x, fmt, scale_rule="compressed-tensors").scales, expected)
    # The rule matters: it moves a sizeable share of the blocks away from the OCP scale.
    assert not torch.equal(pack_mx(x, fmt).scales, expected)


@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.parametrize("fmt", list(MX_FORMATS))
def test_every_rule_keeps_the_ocp_scale_or_raises_it_one_binade(rule, fmt):
    x = blocks_with_edge_maxima(torch.float32)
    raised = pack_mx(x, fmt, scale_rule=rule).scales.int() - pack_mx(x, fmt).scales.int()
    assert bool(((raised == 0) | (raised == 1)).all())
    assert bool((raised == 0).all()) == (rule == "ocp")


def test_rounding_widths_per_rule():
    assert scale_rounding_bits("ocp", 2, 1) is None
    assert [scale_rounding_bits("compressed-tensors", f.ebits, f.mbits) for f in MX_FORMATS.values()] == [1, 1, 3, 1]
    assert [scale_rounding_bits("quark", f.ebits, f.mbits) for f in MX_FORMATS.values()] == [3, 2, 3, 1]
    with pytest.raises(ValueError, match="scale_rule='floor' is not supported; allowed: ocp, compressed-tensors"):
        quantize_mx(torch.ones(32), "mxfp4", scale_rule="floor")
