"""GPTQ rounding inside the chosen MX formats: the algorithm on one weight, the sequential pass over a model, and
the checkpoints it makes (saved, reloaded, exported and read back by compressed-tensors' own code)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_dmx import DMXConfig, MXLinear
from optimum_dmx.calibration import build_calibration_batches, gptq_pack, round_weights_by_gptq
from optimum_dmx.calibration.checkpointing import decoder_layers
from optimum_dmx.calibration.gptq import InverseHessian, SingularHessianError
from optimum_dmx.export import export_checkpoint
from optimum_dmx.formats import get_format, pack_mx, quantize_mx, unpack_mx
from optimum_dmx.nn import emulate_format_map

from .helpers import FORMATS, linear_names

SIZES = {"num_samples": 8, "seq_len": 16, "batch_size": 4}


def _problem(seed: int, out_features: int = 48, in_features: int = 96, tokens: int = 512):
    """A weight and correlated inputs (GPTQ's gain comes from the correlations)."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(in_features, in_features, generator=g) * 0.3 + torch.eye(in_features)
    x = torch.randn(tokens, in_features, generator=g) @ mixing
    return torch.randn(out_features, in_features, generator=g) * 0.05, x


@pytest.mark.parametrize("name", FORMATS)
def test_gptq_halves_the_output_error_of_round_to_nearest_on_correlated_inputs(name):
    fmt = get_format(name)
    weight, x = _problem(seed=FORMATS.index(name))
    xq = quantize_mx(x, fmt)
    packed = gptq_pack(weight, xq.T @ xq / len(xq), fmt)
    assert packed.codes.shape == pack_mx(weight, fmt).codes.shape and packed.scales.shape == (48, 3)
    gptq_error = (xq @ (weight - unpack_mx(packed)).T).pow(2).mean()
    rtn_error = (xq @ (weight - quantize_mx(weight, fmt)).T).pow(2).mean()
    assert gptq_error < 0.7 * rtn_error


@pytest.mark.parametrize("activation_order", [True, False])
@pytest.mark.parametrize("scale_rule", ["ocp", "compressed-tensors", "quark"])
@pytest.mark.parametrize("name", FORMATS)
def test_with_uncorrelated_inputs_gptq_is_round_to_nearest_bit_for_bit(name, scale_rule, activation_order):
    """With a diagonal Hessian no error is fed forward: every code and scale is round-to-nearest's."""
    weight, _ = _problem(seed=1, in_features=80)  # a ragged last block
    hessian = torch.diag(torch.linspace(0.5, 2.0, 80)[torch.randperm(80, generator=torch.Generator().manual_seed(0))])
    packed, expected = (
        gptq_pack(weight, hessian, get_format(name), scale_rule=scale_rule, activation_order=activation_order),
        pack_mx(weight, name, 32, scale_rule),
    )
    assert torch.equal(packed.codes, expected.codes) and torch.equal(packed.scales, expected.scales)


def _element_values(fmt) -> torch.Tensor:
    """Every non-negative value of the format's elements, from its exponent and mantissa widths, in code order."""
    bias = 2 ** (fmt.ebits - 1) - 1
    subnormals = [m / 2**fmt.mbits * 2.0 ** (1 - bias) for m in range(2**fmt.mbits)]
    normals = [(1 + m / 2**fmt.mbits) * 2.0 ** (e - bias) for e in range(1, 2**fmt.ebits) for m in range(2**fmt.mbits)]
    return torch.tensor([v for v in subnormals + normals if v <= fmt.max_normal], dtype=torch.float64)


def _round_to_elements(x: torch.Tensor, fmt) -> torch.Tensor:
    """`x` (float64) to the nearest element value, ties to the even code, beyond the largest saturated."""
    values = _element_values(fmt)
    magnitude = x.abs().clamp(max=fmt.max_normal)
    above = torch.searchsorted(values, magnitude).clamp(1, len(values) - 1)
    low, high = values[above - 1], values[above]
    take_high = (high - magnitude < magnitude - low) | ((high - magnitude == magnitude - low) & (above % 2 == 0))
    return torch.where(take_high, high, low) * x.sign()


def _textbook_gptq_in_activation_order(weight, hessian, fmt, damping=0.01):
    """GPTQ as its paper writes it, in float64: the columns in descending order of the Hessian's diagonal, every
    block's scale from the float weights by the OCP rule (`2^(floor(log2 amax) - emax)`), and after each column
    every later column takes its share of the error at once (no lazy batches). The dequantized weight."""
    amax = weight.double().abs().view(len(weight), -1, 32).amax(-1)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - fmt.emax).repeat_interleave(32, 1)
    order = torch.argsort(hessian.diagonal(), descending=True, stable=True)
    h = hessian.double()[order][:, order]
    h.diagonal().add_(damping * h.diagonal().mean())
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    w, scale = weight.double()[:, order], scale[:, order]
    q = torch.empty_like(w)
    for i in range(w.shape[1]):
        q[:, i] = _round_to_elements(w[:, i] / scale[:, i], fmt) * scale[:, i]
        w[:, i:] -= torch.outer((w[:, i] - q[:, i]) / u[i, i], u[i, i:])
    return torch.empty_like(q).index_copy_(1, order, q)


@pytest.mark.parametrize("name", FORMATS)
def test_gptq_rounds_in_activation_order_as_the_textbook_algorithm_does(name):
    """The library's lazy float32 loop against the textbook's float64 one: the same weights (every one, on the
    machine this was written on), but for the few a float32 sum could put on the other side of a rounding midpoint;
    the columns' own order gives others for more than half of them."""
    fmt = get_format(name)
    weight, x = _problem(seed=7)
    x = x * torch.exp(torch.randn(x.shape[1], generator=torch.Generator().manual_seed(1)))  # inputs of unequal energy
    hessian = x.T @ x / len(x)
    expected = _textbook_gptq_in_activation_order(weight, hessian.double(), fmt)
    in_order, in_columns = (
        unpack_mx(gptq_pack(weight, hessian, fmt, activation_order=ordered)).double() for ordered in (True, False)
    )
    assert (in_order != expected).double().mean() < 0.01
    assert (in_columns != expected).double().mean() > 0.3


@pytest.mark.parametrize("name", FORMATS)
def test_activation_order_lowers_the_output_error_on_inputs_of_unequal_energy(name):
    """What it is for: with inputs whose energies spread as an LLM's activations' do, rounding the columns of the
    most energetic inputs first, while the others can still absorb their errors, halves the layer's output error
    (over twelve problems, 0.46-0.51x on average by format; each below 0.65x)."""
    fmt = get_format(name)
    for seed in range(4):
        weight, x = _problem(seed=seed)
        x = x * torch.exp(torch.randn(x.shape[1], generator=torch.Generator().manual_seed(seed)))
        hessian = x.T @ x / len(x)
        errors = [
            (x @ (weight - unpack_mx(gptq_pack(weight, hessian, fmt, activation_order=ordered))).T).pow(2).mean()
            for ordered in (True, False)
        ]
        assert errors[0] < 0.8 * errors[1]


def test_activation_order_rounds_the_inputs_never_active_last():
    _, x = _problem(seed=2)
    x[:, 5] = 0
    order = InverseHessian.of(x.T @ x / len(x)).order
    energy = (x.T @ x).diagonal()[order]
    assert (
        order[-1] == 5
        and torch.all(energy[:-1] >= energy[1:])
        and InverseHessian.of(x.T @ x, activation_order=False).order is None
    )


def test_inputs_never_active_get_weight_zero():
    weight, x = _problem(seed=2)
    x[:, 5] = 0
    packed = gptq_pack(weight, x.T @ x / len(x), get_format("mxfp8_e4m3"))
    values = unpack_mx(packed)
    assert torch.all(values[:, 5] == 0) and torch.count_nonzero(values[:, 6]) > 0


def test_a_hessian_without_a_cholesky_factor_is_refused():
    weight, _ = _problem(seed=3)
    with pytest.raises(SingularHessianError):
        gptq_pack(weight, -torch.eye(96), get_format("mxfp4_e2m1"))


def test_an_inverse_hessian_computed_once_rounds_like_its_hessian_and_only_for_its_block_size():
    """Linears reading one input (q/k/v) share one factorisation: passing it gives the bits the Hessian gives."""
    weight, x = _problem(seed=4, in_features=80)  # a ragged last block: the factor is padded to 96
    hessian = x.T @ x / len(x)
    inverse = InverseHessian.of(hessian)
    for name in FORMATS:
        by_hessian, by_inverse = (
            gptq_pack(weight, hessian, get_format(name)),
            gptq_pack(weight, inverse, get_format(name)),
        )
        assert torch.equal(by_hessian.codes, by_inverse.codes) and torch.equal(by_hessian.scales, by_inverse.scales)
    with pytest.raises(ValueError, match="covers 96 input features, the weight 80 padded to blocks of 16: 80"):
        gptq_pack(weight, inverse, get_format("mxfp4_e2m1"), block_size=16)


@pytest.fixture(scope="module")
def text_model(tiny_text_model_dir):
    model_dir = tiny_text_model_dir / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = (tiny_text_model_dir / "calibration.txt").read_text()
    ids = build_calibration_batches([text], tokenizer, SIZES["seq_len"], SIZES["num_samples"], 0)
    return model_dir, tokenizer, text, ids


def _hessians_from_whole_passes(model, modules, ids, batch_size):
    """Each module's X^T X / n from ordinary forward passes (no replay), as the served model computes X."""
    sums, counts = {}, {}

    def gather(name):
        def hook(module, args, output):
            x = module.matmul_input(args[0]).reshape(-1, module.in_features).float()
            sums[name] = sums.get(name, 0) + x.T @ x
            counts[name] = counts.get(name, 0) + x.shape[0]

        return hook

    handles = [model.get_submodule(n).register_forward_hook(gather(n)) for n in modules]
    with torch.no_grad():
        for batch in ids.split(batch_size):
            model(input_ids=batch, use_cache=False)
    for handle in handles:
        handle.remove()
    return {n: sums[n] / counts[n] for n in modules}


@pytest.mark.parametrize("formats", [FORMATS, ["mxfp4_e2m1"]], ids=["mixed", "one-format"])
def test_each_layer_is_rounded_from_inputs_the_rounded_layers_before_it_computed(text_model, formats):
    """Sequential GPTQ: the last decoder layer's weights are exactly what GPTQ gives from Hessians that a whole
    forward pass measures with every earlier layer rounded and the layer itself still at round-to-nearest (so the
    replayed passes computed the same inputs); and every layer's rounding differs from round-to-nearest. In one
    format, q/k/v and gate/up share their Hessians: the result is the same as each computing its own."""
    model_dir, _, _, ids = text_model
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = linear_names(model)
    format_map = {name: formats[i % len(formats)] for i, name in enumerate(names)}
    float_linears = {name: model.get_submodule(name) for name in names}
    last = [n for n in names if n.startswith(list(decoder_layers(model))[-1] + ".")]
    with emulate_format_map(model, format_map):
        modules = {name: model.get_submodule(name) for name in names}
        rtn = {name: (m.weight_packed.clone(), m.weight_scale.clone()) for name, m in modules.items()}
        assert round_weights_by_gptq(model, float_linears, ids, SIZES["batch_size"], progress=False) == []
        gptq = {name: (m.weight_packed.clone(), m.weight_scale.clone()) for name, m in modules.items()}
        assert all(not torch.equal(gptq[n][0], rtn[n][0]) for n in names)
        for name in last:
            modules[name].weight_packed.copy_(rtn[name][0])
            modules[name].weight_scale.copy_(rtn[name][1])
        hessians = _hessians_from_whole_passes(model, last, ids, SIZES["batch_size"])
    for name in last:
        expected = gptq_pack(float_linears[name].weight, hessians[name], get_format(format_map[name]))
        assert torch.equal(gptq[name][0], expected.codes) and torch.equal(gptq[name][1], expected.scales), name


def test_a_hessian_pass_ends_before_the_last_linears_matmul(text_model):
    """Each decoder layer's `down_proj` (its last linear) computes once per batch, in the pass that records the
    rounded layer's output: the Hessian pass stops once its input is gathered."""
    model_dir, _, _, ids = text_model
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = linear_names(model)
    float_linears = {name: model.get_submodule(name) for name in names}
    calls: dict[str, int] = {}
    with emulate_format_map(model, dict.fromkeys(names, "mxfp4_e2m1")):
        downs = [n for n in names if n.endswith("down_proj")]
        for name in downs:
            model.get_submodule(name).register_forward_hook(
                lambda m, a, o, n=name: calls.update({n: calls.get(n, 0) + 1})
            )
        round_weights_by_gptq(model, float_linears, ids, SIZES["batch_size"], progress=False)
    assert calls == dict.fromkeys(downs, SIZES["num_samples"] // SIZES["batch_size"])


def test_a_layer_the_calibration_never_reaches_keeps_round_to_nearest_with_one_warning(text_model):
    model_dir, _, _, ids = text_model
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.model.layers[0].mlp.unused = torch.nn.Linear(64, 32, bias=False)  # never called by the forward pass
    names = [*linear_names(model), "model.layers.0.mlp.unused"]
    float_linears = {name: model.get_submodule(name) for name in names}
    with emulate_format_map(model, dict.fromkeys(names, "mxfp4_e2m1")):
        unused = model.get_submodule("model.layers.0.mlp.unused")
        rtn = unused.weight_packed.clone()
        with pytest.warns(RuntimeWarning, match="never reached .*: model.layers.0.mlp.unused$"):
            singular = round_weights_by_gptq(model, float_linears, ids, SIZES["batch_size"], progress=False)
        assert singular == ["model.layers.0.mlp.unused"] and torch.equal(unused.weight_packed, rtn)


def test_only_mx_linears_are_rounded(text_model):
    model_dir, _, _, ids = text_model
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    name = linear_names(model)[0]
    with pytest.raises(TypeError, match=name):
        round_weights_by_gptq(model, {name: model.get_submodule(name)}, ids, 4, progress=False)


def _logit_error(model, reference, ids):
    with torch.no_grad():
        return (model(input_ids=ids).logits - reference).pow(2).mean().item()


@pytest.fixture(scope="module")
def gptq_dir(text_model, tmp_path_factory):
    """Uniform MXFP4 by GPTQ through from_pretrained with a given map, saved."""
    model_dir, tokenizer, text, _ = text_model
    names = linear_names(AutoModelForCausalLM.from_pretrained(model_dir))
    config = DMXConfig(
        format_map=dict.fromkeys(names, "mxfp4_e2m1"),
        weight_rounding="gptq",
        dataset=[text],
        tokenizer=tokenizer,
        scale_rule="compressed-tensors",
        **SIZES,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=config)
    out = tmp_path_factory.mktemp("gptq") / "model"
    model.save_pretrained(out)
    return out


def test_gptq_through_from_pretrained_is_closer_to_the_float_model_and_reloads_exactly(text_model, gptq_dir):
    model_dir, _, _, ids = text_model
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        float_logits = reference(input_ids=ids).logits
    names = linear_names(reference)
    rtn = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=torch.float32,
        quantization_config=DMXConfig(format_map=dict.fromkeys(names, "mxfp4_e2m1"), scale_rule="compressed-tensors"),
    )
    gptq = AutoModelForCausalLM.from_pretrained(gptq_dir, dtype=torch.float32)
    assert all(isinstance(gptq.get_submodule(n), MXLinear) for n in names)
    assert _logit_error(gptq, float_logits, ids) < 0.8 * _logit_error(rtn, float_logits, ids)

    saved = json.loads((gptq_dir / "config.json").read_text())["quantization_config"]
    assert saved["weight_rounding"] == "gptq" and saved["format_map"] == dict.fromkeys(names, "mxfp4_e2m1")
    again = AutoModelForCausalLM.from_pretrained(gptq_dir, dtype=torch.float32)
    for name in names:
        assert torch.equal(again.get_submodule(name).weight_packed, gptq.get_submodule(name).weight_packed)


def test_a_gptq_checkpoint_exported_to_compressed_tensors_gives_our_logits_through_the_real_loader(
    gptq_dir, text_model, tmp_path
):
    ids = text_model[3][:2]
    exported = export_checkpoint(gptq_dir, tmp_path / "ct")
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.bfloat16)
    ours = AutoModelForCausalLM.from_pretrained(gptq_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ours(input_ids=ids).logits)


def test_gptq_with_a_given_map_and_no_data_is_refused_by_name(text_model):
    model_dir = text_model[0]
    with pytest.raises(ValueError, match="weight_rounding='gptq'.*dataset"):
        AutoModelForCausalLM.from_pretrained(
            model_dir,
            quantization_config=DMXConfig(format_map={"model.layers.0.mlp.up_proj": "mxfp4"}, weight_rounding="gptq"),
        )


def test_an_unknown_weight_rounding_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="weight_rounding='awq'.*'rtn', 'gptq'"):
        DMXConfig(weight_rounding="awq")


def test_gptq_is_the_default_when_calibrating_and_rtn_for_a_given_map():
    assert DMXConfig().weight_rounding == "gptq"
    assert DMXConfig(format_map={"m.a": "mxfp4"}).weight_rounding == "rtn"
    assert DMXConfig(format_map={"m.a": "mxfp4"}).to_dict()["weight_rounding"] == "rtn"
    legacy = {"quant_method": "dmx", "format_map": {"m.a": "mxfp4_e2m1"}}  # written before weight_rounding existed
    assert DMXConfig.from_dict(legacy).weight_rounding == "rtn"


def test_gptq_rounds_the_weights_of_online_rotated_layers_from_their_transformed_inputs(text_model, tmp_path):
    """With online input transforms the Hessian is that of the transformed, quantized input: the model ends closer
    to the float logits than round-to-nearest with the same rotation, and reloads to the same logits."""
    model_dir, tokenizer, text, ids = text_model
    with torch.no_grad():
        float_logits = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(input_ids=ids).logits
    names = linear_names(AutoModelForCausalLM.from_pretrained(model_dir))
    errors = {}
    for rounding in ("rtn", "gptq"):
        config = DMXConfig(
            format_map=dict.fromkeys(names, "mxfp4_e2m1"),
            rotation="online_block_hadamard",
            weight_rounding=rounding,
            dataset=[text],
            tokenizer=tokenizer,
            **SIZES,
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=config)
        assert all(model.get_submodule(n).input_transform is not None for n in names)
        errors[rounding] = _logit_error(model, float_logits, ids)
    model.save_pretrained(tmp_path / "dmx")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "dmx", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)
    assert errors["gptq"] < 0.8 * errors["rtn"], errors


def test_gptq_reads_at_most_its_token_budget(text_model, monkeypatch):
    """Only the first sequences that fit `GPTQ_MAX_TOKENS` are read (their hidden states are kept): the result
    equals rounding on those sequences alone."""
    from optimum_dmx.calibration import gptq

    model_dir, _, _, ids = text_model
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = linear_names(model)
    float_linears = {name: model.get_submodule(name) for name in names}
    results = []
    for budget, sequences in ((3 * ids.shape[1], len(ids)), (10**9, 3)):
        monkeypatch.setattr(gptq, "GPTQ_MAX_TOKENS", budget)
        with emulate_format_map(model, dict.fromkeys(names, "mxfp4_e2m1")):
            round_weights_by_gptq(model, float_linears, ids[:sequences], 2, progress=False)
            results.append([model.get_submodule(n).weight_packed.clone() for n in names])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_gptq_reads_the_first_sequences_its_preset_names(text_model, monkeypatch):
    """A preset's `gptq_samples` (the CLI's `cpu-demo`: 64 of 160) limits GPTQ through `from_pretrained` to the
    first calibration sequences: the stored codes are those of rounding on those sequences alone."""
    import dataclasses

    from optimum_dmx.calibration import presets

    model_dir, tokenizer, text, ids = text_model
    monkeypatch.setitem(presets.PRESETS, "cpu-demo", dataclasses.replace(presets.PRESETS["cpu-demo"], gptq_samples=3))
    names = linear_names(AutoModelForCausalLM.from_pretrained(model_dir))
    format_map = dict.fromkeys(names, "mxfp4_e2m1")
    config = DMXConfig(
        format_map=format_map, weight_rounding="gptq", dataset=[text], tokenizer=tokenizer, preset="cpu-demo", **SIZES
    )
    quantized = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=config)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    float_linears = {name: model.get_submodule(name) for name in names}
    with emulate_format_map(model, format_map):
        for sequences, same in ((3, True), (len(ids), False)):
            round_weights_by_gptq(model, float_linears, ids[:sequences], SIZES["batch_size"], progress=False)
            codes = [
                torch.equal(model.get_submodule(n).weight_packed, quantized.get_submodule(n).weight_packed)
                for n in names
            ]
            assert all(codes) if same else not all(codes)
