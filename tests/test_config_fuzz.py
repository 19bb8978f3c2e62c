"""Fuzzing `DMXConfig`: any arguments, and any tampering with a saved config.json's `quantization_config`, either
give a config or raise `ValueError` / `TypeError` whose message names the field; never another exception."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from optimum_dmx import DMXConfig

FIELDS = [
    "target_bits", "format_pair", "method", "preset", "num_samples", "seq_len", "batch_size", "steps", "bit_average",
    "cost_table", "rotation", "learn_rotations", "offset_groups", "scale_rule", "weight_rounding",
    "quantize_activations", "gradient_checkpointing",
    "modules_to_not_convert", "seed", "paper", "format_map", "input_transforms", "achieved_bits",
]  # fmt: skip
GOOD = {
    "target_bits": st.sampled_from([4.0, 4.5, 5, 6.0, 8]),
    "format_pair": st.sampled_from(["mxfp8-mxfp4", "mxfp6-mxfp4"]),
    "method": st.sampled_from(["dmx", "paper", "kl"]),
    "preset": st.sampled_from(["paper", "gpu", "cpu-demo", "cpu-bench"]),
    "num_samples": st.integers(1, 4096),
    "seq_len": st.integers(2, 4096),
    "batch_size": st.integers(1, 64),
    "steps": st.integers(1, 1000),
    "bit_average": st.sampled_from(["simple", "weighted"]),
    "cost_table": st.sampled_from([None, {"mxfp4": {"64x64": 1.0}, "mxfp8_e4m3": {"64x64": 2.5, "32x64": 0.0}}]),
    "rotation": st.sampled_from(["none", "hadamard", "block_hadamard", "online_block_hadamard"]),
    "learn_rotations": st.booleans(),
    "offset_groups": st.sampled_from(["none", "fused", [["a", "b"], ["c"]]]),
    "scale_rule": st.sampled_from(["ocp", "compressed-tensors", "quark"]),
    "weight_rounding": st.sampled_from(["rtn", "gptq"]),
    "quantize_activations": st.booleans(),
    "gradient_checkpointing": st.booleans(),
    "modules_to_not_convert": st.lists(st.sampled_from(["lm_head", "mlp.down_proj"]), max_size=2),
    "seed": st.integers(0, 2**31),
    "paper": st.fixed_dictionaries({}, optional={"lr": st.floats(0.1, 50), "reg_lambda": st.floats(0, 10)}),
    "format_map": st.dictionaries(st.sampled_from(["m.a", "m.b"]), st.sampled_from(["mxfp4", "mxfp8_e4m3"]),
                                  min_size=1),
    "input_transforms": st.just({"m.a": {"type": "randomized_hadamard", "size": 32, "block_size": 32, "seed": 0}}),
    "achieved_bits": st.just({"bits_simple": 5.0, "bits_weighted": 5.1, "storage_bits": 5.3}),
}  # fmt: skip
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(),
    max_size=2), st.sampled_from(["mxfp8", "5", "", "paper", "none", "cpu-demo"]),
)  # fmt: skip


def refusal_names_a_field(error: Exception, fields) -> bool:
    message = str(error)
    names = set(fields) | {"paper", "PaperRecipe", "format_map", "input_transforms", "achieved_bits"}
    return any(name in message for name in names)


def check(make, fields) -> None:
    try:
        make()
    except (ValueError, TypeError) as error:
        assert refusal_names_a_field(error, fields), f"{type(error).__name__}: {error}"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_arguments_give_a_config_or_a_refusal_naming_the_field(data):
    chosen = data.draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=6))
    kwargs = {}
    for field in chosen:
        kwargs[field] = data.draw(st.one_of(GOOD[field], JUNK), label=field)
    check(lambda: DMXConfig(**kwargs), chosen)


VALID = DMXConfig(
    method="paper",
    preset="cpu-bench",
    rotation="online_block_hadamard",
    weight_rounding="gptq",
    format_map={"m.a": "mxfp4", "m.b": "mxfp8"},
    achieved_bits={"bits_simple": 6.0, "bits_weighted": 6.0, "storage_bits": 6.25},
    input_transforms={"m.a": {"type": "randomized_hadamard", "size": 32, "block_size": 32, "seed": 0}},
).to_dict()


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_tampering_with_a_saved_record_loads_or_is_refused_naming_the_field(data):
    record = json.loads(json.dumps(VALID))
    keys = data.draw(st.lists(st.sampled_from(sorted(record)), unique=True, min_size=1, max_size=3))
    for key in keys:
        action = data.draw(st.sampled_from(["drop", "junk", "nested"]), label=key)
        if action == "drop":
            del record[key]
        elif action == "junk" or not isinstance(record[key], dict) or not record[key]:
            record[key] = data.draw(JUNK, label=f"{key} value")
        else:
            inner = data.draw(st.sampled_from(sorted(record[key])), label=f"{key} entry")
            record[key][inner] = data.draw(JUNK, label=f"{key}[{inner}]")
    extra = data.draw(st.sampled_from([None, "unknown_field"]))
    if extra:
        record[extra] = 1
    check(lambda: DMXConfig.from_dict(record), [*keys, *([extra] if extra else [])])
