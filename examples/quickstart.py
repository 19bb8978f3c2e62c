"""Quantize the linear layers of a small transformers model to each MX format and print what that costs.

Runs offline: by default it builds a small randomly initialised Llama; pass a local model folder to use a real
one. For every MX format it reports the storage bits per weight and the relative weight error, then shows how
the dMX offset beta moves one layer continuously from MXFP4 to MXFP8.

    python examples/quickstart.py [MODEL_DIR]
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from optimum_dmx import (
    FORMAT_PAIRS,
    MX_FORMATS,
    pack_mx,
    quantize_mx,
    quantize_mx_continuous,
    unpack_mx,
)


def load_model(path: str | None) -> torch.nn.Module:
    if path:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    )
    return LlamaForCausalLM(config)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact).norm() / exact.norm()).item()


def main() -> None:
    model = load_model(sys.argv[1] if len(sys.argv) > 1 else None)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    print(
        f"{type(model).__name__}: {len(linears)} linear layers, "
        f"{sum(m.weight.numel() for m in linears.values()) / 1e6:.2f}M weights\n"
    )

    print(f"{'format':<12} {'bits/weight':>11} {'size vs bf16':>12} {'rel. weight error':>18}")
    for name, fmt in MX_FORMATS.items():
        errors = [relative_error(quantize_mx(m.weight, fmt), m.weight) for m in linears.values()]
        error = sum(errors) / len(errors)
        print(f"{name:<12} {fmt.storage_bits():>11.2f} {fmt.storage_bits() / 16:>12.3f} {error:>18.4f}")

    layer_name, layer = next(iter(linears.items()))
    packed = pack_mx(layer.weight, "mxfp4")
    assert torch.equal(unpack_mx(packed), quantize_mx(layer.weight, "mxfp4"))
    print(
        f"\n{layer_name} packed as MXFP4: codes {tuple(packed.codes.shape)} uint8, "
        f"scales {tuple(packed.scales.shape)} uint8 (E8M0)"
    )

    pair = FORMAT_PAIRS["mxfp8-mxfp4"]
    print(f"\ndMX pair {pair.name}: beta moves {layer_name} from {pair.low.name} to {pair.high.name}")
    for beta in (0.0, 0.5, 1.0, 1.5, 2.0):
        err = relative_error(quantize_mx_continuous(layer.weight, beta, pair), layer.weight)
        print(
            f"  beta={beta:.1f}  E{pair.exponent_bits(beta):.1f}M{pair.mantissa_bits(beta):.1f}  "
            f"{pair.element_bits(beta):.1f} bits  rel. error {err:.4f}"
        )


if __name__ == "__main__":
    main()
