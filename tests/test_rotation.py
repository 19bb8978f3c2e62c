"""Rotations: randomized Hadamard transforms, function-preserving model rotation (tiny Llama, Qwen3, Gemma 3; fp32
and bf16), online transforms in MXLinear / DMXLinear, a rotated dMX checkpoint reloaded in a fresh process."""

import copy
import json
import logging
import re

import pytest
import scipy.linalg
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from optimum_dmx import DMXConfig, MXLinear
from optimum_dmx.calibration import CalibrationSettings, EndpointProbe, calibrate, dmx_linears
from optimum_dmx.formats import get_format
from optimum_dmx.nn import linear_modules_to_quantize
from optimum_dmx.nn.rotation import resolve_rotation, rotate_model, sign_carriers
from optimum_dmx.nn.surgery import replace_with_mx_linear
from optimum_dmx.nn.transforms import (
    RandomizedHadamard,
    TransformedLinear,
    kronecker_split,
    sylvester_matrix,
)

from .helpers import INPUT_IDS, last_json_line, run_python, tiny_decoder, transforms_kept_online


@pytest.mark.parametrize("n", [1, 2, 32, 256])
def test_the_sylvester_matrix_is_scipys_hadamard_matrix(n):
    reference = torch.from_numpy(scipy.linalg.hadamard(n)).double()
    assert torch.equal(sylvester_matrix(n), reference)
    with pytest.raises(ValueError, match="power-of-two order, got 24"):
        sylvester_matrix(24)


@pytest.mark.parametrize(
    "power, odd, sylvester_order, order",
    [
        (1, 1, 1, 1),
        (16, 1, 1, 16),
        (32, 1, 2, 16),
        (128, 1, 8, 16),
        (256, 1, 16, 16),
        (512, 1, 16, 32),
        (1024, 1, 32, 32),
        (2048, 1, 32, 64),
        (512, 3, 16, 96),
        (64, 9, 4, 144),
        (4, 97, 1, 388),
    ],
)
def test_kronecker_split_of_the_block_transform(power, odd, sylvester_order, order):
    q = torch.linalg.qr(torch.randn(odd, odd, dtype=torch.float64))[0].contiguous()
    stages, matrix = kronecker_split(power, q)
    assert (2**stages, len(matrix)) == (sylvester_order, order)
    product = torch.kron(sylvester_matrix(2**stages), matrix)
    torch.testing.assert_close(product, torch.kron(sylvester_matrix(power), q), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "size, block_size, sign_copies",
    [(96, 32, None), (96, 96, None), (576, 32, None), (576, 576, None), (64, None, None), (2048, 2048, None)]
    + [(1536, 1536, None), (256, 32, (4, 32)), (384, 32, (3, 64))],
)
def test_randomized_hadamard_is_orthogonal_block_diagonal_and_rebuilds_exactly(size, block_size, sign_copies):
    transform = RandomizedHadamard(size, block_size, seed=5, sign_copies=sign_copies)
    matrix = transform.matrix()
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(size, dtype=torch.float64), rtol=0, atol=1e-12)
    block = block_size or size
    assert ((matrix != 0).sum(dim=1) == block).all()  # every row mixes exactly one block
    x = torch.randn(4, 7, size)
    torch.testing.assert_close(transform(x), (x.double() @ matrix).float(), rtol=0, atol=1e-5)
    rebuilt = RandomizedHadamard.from_dict(json.loads(json.dumps(transform.to_dict())))
    assert torch.equal(rebuilt.matrix(), matrix)
    assert not torch.equal(RandomizedHadamard(size, block_size, seed=6, sign_copies=sign_copies).matrix(), matrix)
    copies, run = sign_copies or (1, size)
    signs = transform.signs().view(-1, copies, run)  # each run of signs used `copies` times in a row
    assert torch.equal(signs, signs[:, :1].expand_as(signs)) and rebuilt.key == transform.key
    if copies > 1:  # one drawn sign per copied run: the runs differ from one another
        assert not torch.equal(signs[0, 0], signs[1, 0])


@pytest.mark.parametrize(
    "size, block_size, sign_copies, signed",
    [(96, 32, None, True), (576, 32, None, True), (576, 576, None, True), (1536, 1536, None, True)]
    + [(2048, 2048, None, True), (384, 32, (3, 64), True), (576, 32, None, False), (1536, 512, None, False)],
)
def test_the_transform_applied_from_its_factors_is_the_dense_matrix_and_its_transpose(
    size, block_size, sign_copies, signed
):
    """`apply` (what merges a transform into weights and out of them) computes `x @ T` and `x @ T^T` from the
    factors: the dense matrix's products to float64 rounding, for every factorization (32-blocks as 16 x 2, odd
    factors, 512-blocks as 32 x 16, sign copies, no signs); the inverse undoes the transform."""
    transform = RandomizedHadamard(size, block_size, seed=7, sign_copies=sign_copies, signed=signed)
    matrix = transform.matrix()
    weight = torch.randn(3, 5, size, dtype=torch.float64)
    applied, inverted = transform.apply(weight), transform.apply(weight, inverse=True)
    assert applied.dtype == inverted.dtype == torch.float64 and applied.shape == weight.shape
    torch.testing.assert_close(applied, weight @ matrix, rtol=0, atol=1e-12)
    torch.testing.assert_close(inverted, weight @ matrix.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(transform.apply(applied, inverse=True), weight, rtol=0, atol=1e-12)
    strided = torch.randn(size, 6, dtype=torch.float64).T  # a weight stored transposed: not contiguous
    for direction in (False, True):
        assert torch.equal(transform.apply(strided, direction), transform.apply(strided.contiguous(), direction))
    # signs make T unsymmetric; without them a block is a Sylvester matrix (symmetric) or holds the odd factor (not)
    assert torch.allclose(inverted, applied) == (not signed and transform.odd == 1)
    with pytest.raises(ValueError, match=f"RandomizedHadamard of size {size} applied to a last dimension of 8"):
        transform.apply(torch.ones(2, 8), inverse=True)


@pytest.mark.parametrize("size, block_size", [(64, 64), (128, 128), (96, 32), (576, 576), (1536, 1536)])
def test_the_online_transform_computes_in_float32_under_autocast(size, block_size):
    """Under `torch.autocast` with bfloat16 products (as the KL scan runs a float32 model), the transform's own
    products stay float32: the same values, transformed or transformed and quantized, as outside it."""
    transform = RandomizedHadamard(size, block_size, seed=3)
    x = torch.randn(4, 7, size)
    transformed, quantized = transform(x), transform.quantize(x, get_format("mxfp4_e2m1"), 32, "ocp")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(transform(x), transformed)
        assert torch.equal(transform.quantize(x, get_format("mxfp4_e2m1"), 32, "ocp"), quantized)


@pytest.mark.parametrize("size, block_size, kernels", [(64, 32, "eager"), (512, 512, "eager"), (512, 512, "compiled")])
def test_the_online_transform_of_a_strided_input_is_that_of_its_contiguous_copy(request, size, block_size, kernels):
    """Mamba's `x_proj` reads a transposed view of its mixer's activations (one sequence: its rows are strided). The
    compiled case is the inference path of blocks larger than the kernel's (torch's products, then the cast)."""
    if kernels == "compiled":
        request.getfixturevalue("compiled")
    transform = RandomizedHadamard(size, block_size, seed=3)
    x = torch.randn(1, size, 7).transpose(1, 2)
    assert not x.is_contiguous()
    assert torch.equal(transform(x), transform(x.contiguous()))
    fmt = get_format("mxfp4_e2m1")
    assert torch.equal(transform.quantize(x, fmt, 32, "ocp"), transform.quantize(x.contiguous(), fmt, 32, "ocp"))


@pytest.mark.parametrize("size, block_size", [(96, 32), (512, 512), (576, 32)])
def test_an_unsigned_transform_is_the_plain_block_hadamard_matrix(size, block_size):
    """`signed=False`: `D` is the identity, so the transform is the normalized Sylvester-Hadamard matrix (scipy's)
    on every block, what compressed-tensors' and Quark's Hadamard transforms apply; recorded and rebuilt as such."""
    transform = RandomizedHadamard(size, block_size, seed=5, signed=False)
    block = torch.from_numpy(scipy.linalg.hadamard(block_size)).double() / block_size**0.5
    assert torch.equal(transform.matrix(), torch.block_diag(*[block] * (size // block_size)))
    assert torch.equal(transform.signs(), torch.ones(size, dtype=torch.float64))
    spec = json.loads(json.dumps(transform.to_dict()))
    assert spec["signed"] is False and RandomizedHadamard.from_dict(spec).key == transform.key
    signed = RandomizedHadamard(size, block_size, seed=5)
    assert "signed" not in signed.to_dict() and signed.key != transform.key  # checkpoints of earlier versions: signed
    assert not torch.equal(signed.matrix(), transform.matrix())
    with pytest.raises(ValueError, match="'signed' must be true or false, got 'no'"):
        RandomizedHadamard.from_dict(spec | {"signed": "no"})


@pytest.mark.parametrize("size, block_size, sign_copies", [(192, 64, None), (1536, 512, None), (128, 32, (2, 32))])
def test_a_transform_splits_into_its_signs_and_the_same_transform_without_them(size, block_size, sign_copies):
    """`split_signs`: `T = D B` exactly, `B` the transform without signs recorded with the same seed; a transform with
    an odd factor (whose random matrix another draw would change) is refused."""
    transform = RandomizedHadamard(size, block_size, seed=7, sign_copies=sign_copies)
    signs, unsigned = transform.split_signs()
    assert not unsigned.signed and unsigned.seed == 7 and unsigned.sign_copies == transform.sign_copies
    assert torch.equal(signs, transform.signs()) and not torch.all(signs == 1)
    assert torch.equal(signs[:, None] * unsigned.matrix(), transform.matrix())
    assert RandomizedHadamard.from_dict(unsigned.to_dict()).key == unsigned.key
    x = torch.randn(3, size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unsigned(x * signs.float()), transform(x))
    with pytest.raises(ValueError, match="split_signs needs a power-of-two block_size, got 96"):
        RandomizedHadamard(192, 96, seed=7).split_signs()


def test_randomized_hadamard_rejects_bad_sizes():
    with pytest.raises(ValueError, match="block_size=48"):
        RandomizedHadamard(64, 48)
    with pytest.raises(ValueError, match="unknown input transform"):
        RandomizedHadamard.from_dict({"type": "givens", "size": 4})
    for bad in ((5, 32), (2,), (0, 32), "2x32", (2.0, 32)):
        with pytest.raises(ValueError, match=r"sign_copies \(copies, run\).*size=96"):
            RandomizedHadamard(96, 32, sign_copies=bad)


def _rotated_copy(kind: str, rotation: str, dtype: torch.dtype) -> tuple[nn.Module, nn.Module, dict, list[str]]:
    """A tiny tied model of `kind`, its rotated copy, transforms and quantized names; asserts their logits agree
    (float tolerance)."""
    model = tiny_decoder(kind, tied=True, dtype=dtype)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits.float()
    rotated = copy.deepcopy(model)
    quantized = list(linear_modules_to_quantize(rotated, ["lm_head"]))
    transforms = rotate_model(rotated, rotation, quantized, block_size=32, seed=0)
    with torch.no_grad():
        logits = rotated(ids).logits.float()
    tolerance = 1e-4 if dtype == torch.float32 else 0.08 * reference.abs().max().item()
    assert (logits - reference).abs().max().item() < tolerance
    return model, rotated, transforms, quantized


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("block_size", [32, None])
def test_rotations_merge_from_their_factors_as_from_their_matrices(kind, block_size):
    """`merge_rotations` takes a `RandomizedHadamard` (how `rotate_model` merges its random rotations: from its
    factors) or its dense matrix (how learned rotations merge): the same weights and biases, up to float64 sums
    in another order rounded to float32, on the residual stream (96 = 3 x 32: an odd factor) and per head (32)."""
    from optimum_dmx.nn.rotation import fold_norm_scales, merge_rotations, rotation_sites

    model = tiny_decoder(kind, tied=False)
    fold_norm_scales(model)
    sites = rotation_sites(model)
    size, head_dim = model.config.hidden_size, model.config.head_dim
    residual = RandomizedHadamard(size, block_size or size, seed=1) if sites.residual else None
    heads = [RandomizedHadamard(head_dim, block_size or head_dim, seed=2 + i) for i in range(len(sites.heads))]
    dense = copy.deepcopy(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    merge_rotations(model, sites, residual, heads)
    merge_rotations(dense, rotation_sites(dense), residual and residual.matrix(), [h.matrix() for h in heads])
    changed = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    assert "model.layers.0.self_attn.v_proj.weight" in changed and "model.layers.1.self_attn.o_proj.weight" in changed
    assert ("model.embed_tokens.weight" in changed) == (residual is not None)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter, dense.get_parameter(name), rtol=2e-7, atol=1e-7, msg=name)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("rotation", ["hadamard", "block_hadamard"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rotation_preserves_the_models_function(kind, rotation, dtype):
    model, rotated, transforms, _ = _rotated_copy(kind, rotation, getattr(torch, dtype))
    assert sorted(transforms) == [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    assert all(isinstance(rotated.get_submodule(name), TransformedLinear) for name in transforms)
    # online: a pure Hadamard transform, on the largest power of two dividing the intermediate size 192 = 64 x 3
    assert all(spec["block_size"] == (64 if rotation == "hadamard" else 32) for spec in transforms.values())
    changed = [n for n, p in rotated.named_parameters() if not torch.equal(p, model.get_parameter(n))]
    assert "model.layers.0.self_attn.v_proj.weight" in changed  # per-head rotation everywhere
    if kind == "gemma3":  # post-block norms: the residual stream keeps its basis, the embeddings stay tied
        assert "model.embed_tokens.weight" not in changed
        assert rotated.lm_head.weight is rotated.model.embed_tokens.weight
    else:
        assert "model.embed_tokens.weight" in changed
        assert rotated.lm_head.weight is not rotated.model.embed_tokens.weight
        assert rotated.config.tie_word_embeddings is False
        assert all(torch.all(rotated.get_submodule(f"model.layers.{i}.input_layernorm").weight == 1) for i in range(2))


@pytest.mark.parametrize(
    "rotation, dtype, kernels",
    [  # compiled: the large blocks' kernel in float32, the 32-block kernel's bfloat16 factor without signs. Slow
        # (80-110 s each, compiling every kernel of both models): the kernels' bits are the eager path's
        # (tests/test_compilation.py), so the eager cases decide in the default suite.
        pytest.param("hadamard", torch.float32, "compiled", marks=pytest.mark.slow),
        pytest.param("online_block_hadamard", torch.bfloat16, "compiled", marks=pytest.mark.slow),
        ("hadamard", torch.bfloat16, "eager"),
        ("online_block_hadamard", torch.float32, "eager"),
    ],
)
def test_signs_go_into_the_modules_producing_the_inputs_and_change_no_bit_of_the_quantized_model(
    request, rotation, dtype, kernels
):
    """An online transform `T = D B` leaves `D` to the module producing its input (`up_proj`'s rows for
    `down_proj`, `v_proj`'s for `o_proj`, one copy per value head, a norm's scale for q/k/v and gate/up) and applies
    `B` (64-blocks of the tiny model's 192 for `hadamard`: the large blocks' kernel; 32-blocks: the whole transform
    in one). The MX-quantized model computes the bits of the same model rotated with `T` online and its carriers
    unsigned, as rotations ran before (both with `o_proj`'s transform online: merged into `v_proj`, it rounds
    differently, `test_o_proj_takes_its_input_transformed_by_v_proj_where_attention_passes_a_mix_on`)."""
    if kernels == "compiled":
        request.getfixturevalue("compiled")
    with transforms_kept_online():
        _, model, transforms, quantized = _rotated_copy("llama", rotation, dtype)  # the float function kept
    with transforms_kept_online(signs=True):
        _, signs_online, signed_transforms, _ = _rotated_copy("llama", rotation, dtype)
    carriers = sign_carriers(tiny_decoder("llama", tied=True, dtype=dtype), quantized)
    assert set(transforms) <= set(carriers) and len(set(carriers[name] for name in transforms)) >= 2
    expected = {n: m.weight for n, m in signs_online.named_modules() if getattr(m, "weight", None) is not None}
    carried = {}  # carrier: the signs it takes (the readers of one norm share them)
    for name, spec in transforms.items():
        assert spec["signed"] is False and not model.get_submodule(name).input_transform.signed
        assert signed_transforms[name] == {k: v for k, v in spec.items() if k != "signed"}  # the same draw
        signs = RandomizedHadamard.from_dict(signed_transforms[name]).signs().to(dtype)
        assert not torch.all(signs == 1) and torch.equal(carried.setdefault(carriers[name], signs), signs)
    for carrier, signs in carried.items():
        weight = expected[carrier]
        if weight.dim() == 2 and weight.shape[0] < len(signs):  # v_proj: one copy of the signs per value head
            copies, run = transforms[carrier.replace("v_proj", "o_proj")]["sign_copies"]
            signs = signs.view(-1, copies, run)[:, 0].flatten()
        expected[carrier] = weight * signs.view(-1, *(1,) * (weight.dim() - 1))
    for name, module in model.named_modules():
        if name in expected:
            assert torch.equal(module.weight, expected[name]), name  # negated where the signs went, else equal
    format_map = {name: "mxfp4_e2m1" if i % 3 else "mxfp8_e4m3" for i, name in enumerate(quantized)}
    for quantized_model in (model, signs_online):
        replace_with_mx_linear(quantized_model, format_map)
    with torch.no_grad():
        assert torch.equal(model(INPUT_IDS).logits, signs_online(INPUT_IDS).logits)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_online_block_rotation_transforms_every_quantized_input_and_preserves_the_function(kind, dtype):
    """Every quantized linear's input is transformed: online, or for `o_proj` by `v_proj`, whose rows take the whole
    transform (signs, then the Hadamard matrix on each 32 of a value head's outputs); the function is kept
    (`_rotated_copy`)."""
    model, rotated, transforms, quantized = _rotated_copy(kind, "online_block_hadamard", getattr(torch, dtype))
    o_projs = [name for name in quantized if name.endswith("o_proj")]
    assert sorted(transforms) == sorted(set(quantized) - set(o_projs))
    assert all(s["block_size"] == 32 for s in transforms.values())
    hadamard = sylvester_matrix(32).double() / 32**0.5
    for layer in range(2):  # the linears reading one input share its transform; the others have their own
        prefix = f"model.layers.{layer}."
        seeds = {name.removeprefix(prefix): s["seed"] for name, s in transforms.items() if name.startswith(prefix)}
        assert seeds["self_attn.q_proj"] == seeds["self_attn.k_proj"] == seeds["self_attn.v_proj"]
        assert seeds["mlp.gate_proj"] == seeds["mlp.up_proj"]
        assert len({seeds[n] for n in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj")}) == 3
        # o_proj: a plain linear holding W T; v_proj's rows (2 value heads of 32, each read by 2 query heads) are
        # H D W_v per block of 32: random signs, then the Hadamard matrix, as o_proj's transform within a head
        assert type(rotated.get_submodule(prefix + "self_attn.o_proj")) is nn.Linear
        qkv = RandomizedHadamard.from_dict({**transforms[prefix + "self_attn.v_proj"], "signed": kind != "gemma3"})
        original = qkv.apply(model.get_submodule(prefix + "self_attn.v_proj").weight.double())  # W_v T_qkv
        v_proj = rotated.get_submodule(prefix + "self_attn.v_proj").weight.double()
        for block in range(2):
            rows = slice(32 * block, 32 * (block + 1))
            mix = v_proj[rows] @ torch.linalg.pinv(original[rows])  # v_proj's block = mix @ the original block
            signs = hadamard @ mix  # D: a diagonal of random signs
            tolerance = 1e-5 if dtype == "float32" else 0.05
            torch.testing.assert_close(signs, torch.diag(signs.diagonal().sign()), atol=tolerance, rtol=0)
            assert 0 < (signs.diagonal() < 0).sum() < 32
        # the norms' scales take the signs of q/k/v's and gate/up's transforms, but Gemma's, which scale by
        # 1 + weight: their readers' transforms draw none
        mlp_norm = "pre_feedforward_layernorm" if kind == "gemma3" else "post_attention_layernorm"
        for norm, reader in (("input_layernorm", "self_attn.q_proj"), (mlp_norm, "mlp.gate_proj")):
            drawn = RandomizedHadamard.from_dict({**transforms[prefix + reader], "signed": True}).signs()
            signs = torch.ones(96) if kind == "gemma3" else drawn.to(rotated.dtype)
            original = model.get_submodule(prefix + norm).weight
            assert torch.equal(rotated.get_submodule(prefix + norm).weight, original * signs.to(original.dtype))
    assert rotated.lm_head.weight is rotated.model.embed_tokens.weight  # nothing merged into the residual stream
    assert torch.equal(rotated.model.embed_tokens.weight, model.model.embed_tokens.weight)
    # online, every transform is the plain block Hadamard matrix: its signs are in the modules producing its input
    assert all(spec["signed"] is False for spec in transforms.values())


def test_o_proj_keeps_its_transform_online_with_signs_copied_across_the_query_heads_of_a_value_head():
    """Where `o_proj`'s transform stays online (as earlier versions kept it), its signs, in `v_proj`'s rows, are
    equal across the query heads reading one value head (4 query heads, 2 value heads of 32), its own for each value
    head."""
    with transforms_kept_online(signs=True):
        _, _, transforms, _ = _rotated_copy("llama", "online_block_hadamard", torch.float32)
    for layer in range(2):
        spec = transforms[f"model.layers.{layer}.self_attn.o_proj"]
        assert spec["sign_copies"] == [2, 32]
        by_head = RandomizedHadamard.from_dict(spec).signs().view(2, 2, 32)
        assert torch.equal(by_head[:, 0], by_head[:, 1]) and not torch.equal(by_head[0, 0], by_head[1, 0])
        assert "sign_copies" not in transforms[f"model.layers.{layer}.self_attn.q_proj"]


def test_rotation_keeps_float_down_proj_without_online_transform():
    model = tiny_decoder("llama", tied=False)
    quantized = linear_modules_to_quantize(model, ["lm_head", "down_proj"])
    assert rotate_model(model, "block_hadamard", quantized) == {}
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear


def test_rotation_refuses_models_it_cannot_rotate():
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="Llama-style decoder layers|decoder-only model"):
        rotate_model(model, "hadamard", {})
    with pytest.raises(ValueError, match="rotation='givens' is not supported; allowed: auto, none, hadamard"):
        rotate_model(tiny_decoder("llama", tied=False), "givens", {})
    with pytest.raises(ValueError, match="rotation='givens'"):
        DMXConfig(format_map={}, rotation="givens")


def test_auto_rotation_is_online_where_an_export_can_carry_it_and_none_elsewhere(caplog):
    """`"auto"` resolves per model: online transforms where every quantized linear is a plain `nn.Linear` of whole
    MX blocks (with random signs where an export can move them: `sign_carriers`), no rotation (with a warning
    naming why) on the others; `rotate_model` refuses it unresolved."""
    llama = tiny_decoder("llama", tied=True)
    quantized = linear_modules_to_quantize(llama, ["lm_head"])
    for model in (llama, tiny_decoder("qwen3", tied=False), tiny_decoder("gemma3", tied=True)):
        assert resolve_rotation(model, "auto", quantized) == "online_block_hadamard"
    assert resolve_rotation(llama, "block_hadamard", quantized) == "block_hadamard"  # anything else: as it is
    with pytest.raises(ValueError, match="rotation='auto' depends on the model: resolve it"):
        rotate_model(llama, "auto", quantized)
    cases = [  # model, quantized linears, what the warning names
        (tiny_decoder("llama", tied=True, hidden_size=80, head_dim=20), None, "has 80 inputs, not a whole number"),
        (
            GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=64)),
            ["transformer.h.0.mlp.c_fc"],
            r"transformer.h.0.mlp.c_fc is a Conv1D, not a plain nn.Linear",
        ),
    ]
    for model, names, obstacle in cases:
        names = linear_modules_to_quantize(model, ["lm_head"]) if names is None else names
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="optimum_dmx.nn.rotation"):
            assert resolve_rotation(model, "auto", names) == "none"
        assert "rotation='auto' leaves this model unrotated" in caplog.text
        assert re.search(obstacle, caplog.text), caplog.text
    # asked for explicitly, the same per-linear obstacle is a refusal naming the layer
    narrow = cases[0][0]
    with pytest.raises(ValueError, match="rotation='online_block_hadamard': model.layers.0.self_attn.q_proj has 80"):
        rotate_model(narrow, "online_block_hadamard", linear_modules_to_quantize(narrow, ["lm_head"]))


def test_sign_carriers_are_the_layers_and_norms_an_export_can_negate():
    """Where each online transform's signs can go: a Llama's norms, `v_proj` (signs copied across the 2 query heads
    of a value head) and `up_proj`; not a norm some of whose readers stay in float, not Gemma's `1 + weight`
    norms, and not into an `up_proj` that is missing or the wrong size."""
    llama = tiny_decoder("llama", tied=True)
    quantized = list(linear_modules_to_quantize(llama, ["lm_head"]))
    expected = {}
    for i in range(2):
        layer = f"model.layers.{i}"
        expected |= {f"{layer}.self_attn.{p}": f"{layer}.input_layernorm" for p in ("q_proj", "k_proj", "v_proj")}
        expected |= {f"{layer}.mlp.{p}": f"{layer}.post_attention_layernorm" for p in ("gate_proj", "up_proj")}
        expected |= {
            f"{layer}.self_attn.o_proj": f"{layer}.self_attn.v_proj",
            f"{layer}.mlp.down_proj": f"{layer}.mlp.up_proj",
        }
    assert sign_carriers(llama, quantized) == expected
    without_k = [n for n in quantized if n != "model.layers.0.self_attn.k_proj"]
    assert sign_carriers(llama, without_k) == {
        n: c for n, c in expected.items() if n in without_k and c != "model.layers.0.input_layernorm"
    }
    gemma = tiny_decoder("gemma3", tied=True)
    assert sign_carriers(gemma, quantized) == {n: c for n, c in expected.items() if n.endswith(("o_proj", "down_proj"))}


@pytest.mark.parametrize(
    "family, without_signs, with_signs",
    [
        ("nemotron", ["model.layers.0.mlp.down_proj"], ["model.layers.0.self_attn.o_proj"]),  # relu(up_proj(x)) ** 2
        ("arcee", ["model.layers.1.mlp.down_proj"], ["model.layers.1.self_attn.o_proj"]),  # the same
        ("mpt", ["transformer.blocks.0.ffn.down_proj", "transformer.blocks.1.ffn.down_proj"], []),  # gelu(up_proj(x))
        # a gated delta net's values pass a convolution and SiLU; the softmax attention layer's do not
        ("olmo_hybrid", ["model.layers.0.linear_attn.o_proj"], ["model.layers.1.self_attn.o_proj"]),
        ("qwen2", [], ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj",
                       "model.layers.1.mlp.down_proj"]),
    ],
)  # fmt: skip
def test_online_transform_signs_go_only_where_the_model_passes_them_on(family, without_signs, with_signs):
    """Names propose where an online transform's signs can go (`up_proj` for `down_proj`, `v_proj` for `o_proj`, a
    norm for its readers); the model's own forward pass decides (`nn.sign_probe`). The rotation moves them there, and
    the rotated model computes the original function; without the probe, the four families' signs would go where
    they do not pass on, and the logits would be off by about their own size."""
    from .test_transformers_families import EXTRA, SMALL

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **SMALL, **EXTRA.get(family, {}))
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # weights large enough that a sign which does not pass on shows in the logits
        for parameter in model.parameters():
            parameter.normal_(0, 0.3)
    quantized = list(linear_modules_to_quantize(model, ["lm_head"]))
    carriers = sign_carriers(model, quantized)
    assert set(with_signs) <= set(carriers) and not set(carriers) & set(without_signs)
    ids = torch.randint(3, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    _assert_online_rotation_keeps_the_function(model, quantized, ids)


@pytest.mark.parametrize(
    "family, online, merged",
    [
        ("llama", [], ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]),
        ("qwen2", [], ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]),  # biased v_proj
        # the attention output is gated by a sigmoid element by element: it passes signs on, not a mix
        ("afmoe", ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"], []),
        ("qwen3_next", ["model.layers.3.self_attn.o_proj"], []),
        # a gated delta net's values pass a convolution and SiLU; the softmax attention layer's do not
        ("olmo_hybrid", ["model.layers.0.linear_attn.o_proj"], ["model.layers.1.self_attn.o_proj"]),
    ],
)
def test_o_proj_takes_its_input_transformed_by_v_proj_where_attention_passes_a_mix_on(family, online, merged):
    """`o_proj`'s whole transform (signs and a Hadamard mix within blocks of 8 of its heads of 16) goes into `v_proj`'s
    rows where the model's forward pass shows that a mix of `v_proj`'s output reaches `o_proj`'s input as it is
    (`nn.sign_probe`), and that `o_proj` keeps no online transform; elsewhere it stays online. The rotated model
    computes the original function."""
    from .test_transformers_families import EXTRA, SMALL

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**SMALL, **EXTRA.get(family, {})})
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # weights large enough that a transform which does not pass on shows in the logits
        for parameter in model.parameters():
            parameter.normal_(0, 0.3)
    quantized = list(linear_modules_to_quantize(model, ["lm_head"]))
    ids = torch.randint(3, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        original = model(ids).logits
        transforms = rotate_model(model, "online_block_hadamard", quantized, block_size=8)
        rotated = model(ids).logits
    o_projs = [name for name in quantized if name.endswith("o_proj")]
    assert [n for n in o_projs if n in transforms] == online and [n for n in o_projs if n not in transforms] == merged
    assert all(type(model.get_submodule(name)) is nn.Linear for name in merged)
    assert (rotated - original).abs().max() < 1e-4 * original.abs().max()


def _assert_online_rotation_keeps_the_function(model: nn.Module, quantized: list[str], ids: torch.Tensor) -> None:
    """Rotate the float32 `model` in place with `"online_block_hadamard"`: every transform runs without signs, and
    the logits on `ids` are the original ones to float rounding (a sign moved where it does not pass on changes them
    by about their own size)."""
    with torch.no_grad():
        original = model(ids).logits
        transforms = rotate_model(model, "online_block_hadamard", quantized)
        rotated = model(ids).logits
    assert not any(RandomizedHadamard.from_dict(spec).signed for spec in transforms.values())
    assert (rotated - original).abs().max() < 1e-4 * original.abs().max()


def _parallel_block(layer: nn.Module, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """A Llama decoder layer's forward as a parallel block (GPT-J's, Cohere's): attention and MLP both read
    `input_layernorm`'s output; `post_attention_layernorm` is unused."""
    normed = layer.input_layernorm(hidden_states)
    attention, _ = layer.self_attn(hidden_states=normed, **kwargs)
    return hidden_states + attention + layer.mlp(normed)


def test_no_signs_move_where_a_norm_feeds_more_than_the_readers_its_names_propose(caplog):
    """With Llama's module names, `input_layernorm` is proposed as the carrier of q/k/v's signs, and q/k/v do
    receive them; in a parallel block the MLP reads that norm too and would receive them as well. The probe sees the
    logits change although each proposed reader was handed its unsigned input, moves no signs anywhere and says
    so; the rotated model computes the original function (without that check it does not)."""
    import types

    model = tiny_decoder("llama", tied=True)
    quantized = list(linear_modules_to_quantize(model, ["lm_head"]))
    assert "model.layers.0.self_attn.q_proj" in sign_carriers(model, quantized)  # a sequential block: signs move
    for layer in model.model.layers:
        layer.forward = types.MethodType(_parallel_block, layer)
    with caplog.at_level(logging.WARNING, logger="optimum_dmx.nn.sign_probe"):
        assert sign_carriers(model, quantized) == {}
    assert "reached more than the modules that read it as the model's names say" in caplog.text
    assert "model.layers.0.input_layernorm" in caplog.text
    _assert_online_rotation_keeps_the_function(model, quantized, INPUT_IDS)


def test_mx_and_dmx_linears_apply_the_online_transform():
    """An MXLinear / DMXLinear built from a TransformedLinear quantizes the transformed input."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 16)
    transform = RandomizedHadamard(64, 32, seed=1)
    with torch.no_grad():
        linear.weight.copy_((linear.weight.double() @ transform.matrix()).float())
    transformed = TransformedLinear(linear, transform)
    x = torch.randn(3, 64)
    mx = MXLinear.from_linear(transformed, "mxfp8_e4m3")
    plain = MXLinear.from_linear(linear, "mxfp8_e4m3")
    assert mx.input_transform is transform
    assert torch.equal(mx(x), plain(transform(x)))
    model = nn.Sequential(transformed)
    settings = CalibrationSettings(
        target_bits=6, num_samples=1, seq_len=2, batch_size=1, steps=1, modules_to_not_convert=[]
    )
    probe = EndpointProbe()
    with dmx_linears(model, settings, lambda: probe) as layers:
        layer = layers["0"]
        probe.set(2.0, torch.device("cpu"), measure=False)
        assert torch.equal(layer(x), MXLinear.from_linear(linear, "mxfp8_e4m3", input_transform=transform)(x))


def test_linears_sharing_an_online_transform_transform_and_quantize_their_input_once(monkeypatch):
    """q/k/v and gate/up of an `online_block_hadamard` model, each with its own transform object rebuilt from the
    records (as a reloaded model has them), transform and quantize their input once per forward: 3 times per decoder
    layer (q/k/v, gate/up, down_proj; o_proj's input comes transformed by v_proj), not 6. The logits are those of
    modules that share nothing."""
    model = tiny_decoder("llama", tied=True)
    quantized = linear_modules_to_quantize(model, ["lm_head"])
    transforms = rotate_model(model, "online_block_hadamard", quantized)
    assert sorted(transforms) == sorted(n for n in quantized if not n.endswith("o_proj"))
    for name, spec in transforms.items():
        model.get_submodule(name).input_transform = RandomizedHadamard.from_dict(spec)
    replace_with_mx_linear(model, dict.fromkeys(quantized, "mxfp4_e2m1"))
    calls = []
    quantize = RandomizedHadamard.quantize
    monkeypatch.setattr(RandomizedHadamard, "quantize", lambda self, *a: calls.append(self.key) or quantize(self, *a))
    with torch.no_grad():
        shared = model(INPUT_IDS).logits
        assert len(calls) == 2 * 3 and len(set(calls)) == 2 * 3
        for name in quantized:
            model.get_submodule(name).input_casts = None
        assert torch.equal(model(INPUT_IDS).logits, shared)
    assert len(calls) == 2 * 3 + 2 * 6


def test_calibrating_a_rotated_model_runs_with_the_online_transforms():
    model = tiny_decoder("llama", tied=True)
    rotate_model(model, "block_hadamard", linear_modules_to_quantize(model, ["lm_head"]))
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    result = calibrate(
        model, ids, CalibrationSettings(target_bits=5, num_samples=8, seq_len=16, batch_size=2, steps=4), progress=False
    )
    assert abs(result.bits_weighted - 5) <= 0.3
    assert isinstance(model.model.layers[0].mlp.down_proj, TransformedLinear)  # put back after calibration


@pytest.fixture(scope="module")
def rotated_dmx(tmp_path_factory):
    """A tiny tied-embedding Llama quantized with rotation='block_hadamard' and an explicit map, saved."""
    root = tmp_path_factory.mktemp("rotated")
    tiny_decoder("llama", tied=True).save_pretrained(root / "float")
    names = [
        f"model.layers.{i}.{m}"
        for i in range(2)
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    format_map = {name: ("mxfp8_e4m3", "mxfp4_e2m1", "mxfp6_e2m3")[i % 3] for i, name in enumerate(names)}
    config = DMXConfig(format_map=format_map, rotation="block_hadamard")
    model = AutoModelForCausalLM.from_pretrained(root / "float", quantization_config=config)
    model.save_pretrained(root / "dmx")
    with torch.no_grad():
        logits = model(INPUT_IDS).logits
    return root, format_map, logits


def test_rotated_checkpoint_records_its_transforms_and_reloads_exactly(rotated_dmx):
    root, format_map, logits = rotated_dmx
    config = json.loads((root / "dmx" / "config.json").read_text())
    quantization = config["quantization_config"]
    assert quantization["rotation"] == "block_hadamard"
    assert sorted(quantization["input_transforms"]) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert config["tie_word_embeddings"] is False  # untied: lm_head holds its own rotated matrix
    code = f"""
import json, torch
from transformers import AutoModelForCausalLM
import optimum_dmx
model = AutoModelForCausalLM.from_pretrained({str(root / "dmx")!r})
with torch.no_grad():
    torch.save(model(torch.tensor({INPUT_IDS.tolist()})).logits, {str(root / "reloaded.pt")!r})
transforms = {{n: m.input_transform.to_dict() for n, m in model.named_modules()
              if isinstance(m, optimum_dmx.MXLinear) and m.input_transform is not None}}
print(json.dumps({{"transforms": transforms}}))
"""
    result = last_json_line(run_python(code))
    assert result["transforms"] == quantization["input_transforms"]
    assert torch.equal(torch.load(root / "reloaded.pt"), logits)


def test_rotated_model_stays_close_to_the_float_model_and_dequantizes(rotated_dmx):
    root, _, logits = rotated_dmx
    model = AutoModelForCausalLM.from_pretrained(root / "dmx")
    model.dequantize()
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, TransformedLinear)  # the float model keeps the online transform it needs
    with torch.no_grad():
        dequantized = model(INPUT_IDS).logits
    float_logits = AutoModelForCausalLM.from_pretrained(root / "float")(INPUT_IDS).logits
    # MX weights without activation quantization: nearer the float model than the quantized logits are
    assert (dequantized - float_logits).abs().mean() < (logits - float_logits).abs().mean()


def test_a_rotated_model_moves_between_dtypes_and_devices_like_any_model(rotated_dmx):
    """`.to(...)` and `.bfloat16()` pass the online transforms' modules (`nn.Module._apply`): a move to the same
    dtype and device changes nothing, and a model moved to bfloat16 computes about what one loaded in it computes
    (not exactly: transformers keeps a loaded model's rotary frequencies in float32, which a move rounds)."""
    root, _, logits = rotated_dmx

    def load(dtype: torch.dtype) -> nn.Module:
        return AutoModelForCausalLM.from_pretrained(root / "dmx", dtype=dtype)

    with torch.no_grad():
        assert torch.equal(load(torch.float32).to("cpu", torch.float32)(INPUT_IDS).logits, logits)
        in_bfloat16 = load(torch.bfloat16)(INPUT_IDS).logits
        for moved in (load(torch.float32).bfloat16(), load(torch.float32).to(torch.bfloat16)):
            difference = (moved(INPUT_IDS).logits - in_bfloat16).abs().max()
            assert difference <= 0.05 * in_bfloat16.abs().max()
