"""Make a dMX model vLLM can serve, export it, and generate with vLLM (needs vLLM and a GPU with MX support).

    # calibrate a float model the way vLLM serves it, then export and serve:
    python examples/serve_with_vllm.py MODEL --calibrate TEXT_FILE [--target-bits 5] [--preset gpu]
    # or export and serve a saved dMX model:
    python examples/serve_with_vllm.py DMX_DIR [--to compressed-tensors|quark] [--output DIR] [--prompt TEXT]

With `--calibrate`, the model is calibrated with what a served model needs: `offset_groups="fused"` (vLLM runs
q/k/v and gate/up as one matmul, so they share a format), `scale_rule` the target's (its activation scales are then
computed as vLLM computes them), and `rotation="online_block_hadamard"` (a 32-block Hadamard transform of every
quantized linear's input: on SmolLM2-135M at 5 bits, 12% / 9% lower held-out perplexity than the unrotated map,
`benchmarks/results/quality.md`), whose transforms the export writes as the target's own (compressed-tensors'
`transform_config`, Quark's online rotation). `compressed-tensors` suits the mxfp8-mxfp4 pair (vLLM serves MXFP4 and
MXFP8 through it); `quark` the mxfp6-mxfp4 pair.

vLLM applies compressed-tensors' input transforms with `CompressedTensorsLinearTransformMethod` (vLLM's
`model_executor/layers/quantization/compressed_tensors/transform/`), which requires the parts of a fused layer to
share one input transform (the export gives q/k/v one and gate/up one) and layers without bias: a model with
biased projections (Qwen2's q/k/v, an MLP bias) cannot be served with transforms there. This script is not run by
the test suite past `import vllm` (no GPU or vLLM there): the calibration and export are, and the exported model is
tested against the loaders' own code in transformers. No vLLM version has been run with it here.
"""

import argparse
from pathlib import Path

from optimum_dmx.export import EXPORT_TARGETS, export_checkpoint


def calibrate_for_serving(model: str, text_file: Path, target: str, target_bits: float, preset: str, output: Path):
    """Calibrate `model` on `text_file` as vLLM serves it (see the module docstring) and save it to `output`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from optimum_dmx import DMXConfig

    tokenizer = AutoTokenizer.from_pretrained(model)
    config = DMXConfig(
        target_bits=target_bits,
        format_pair="mxfp8-mxfp4" if target == "compressed-tensors" else "mxfp6-mxfp4",
        dataset=[text_file.read_text(encoding="utf-8")],
        tokenizer=tokenizer,
        preset=preset,
        rotation="online_block_hadamard",
        offset_groups="fused",
        scale_rule=target,
    )
    AutoModelForCausalLM.from_pretrained(model, quantization_config=config).save_pretrained(output)
    tokenizer.save_pretrained(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a saved dMX model folder, or with --calibrate a float model (folder or Hub id)")
    parser.add_argument("--calibrate", type=Path, metavar="TEXT_FILE", help="calibrate the float model on this text")
    parser.add_argument("--target-bits", type=float, default=5.0)
    parser.add_argument("--preset", default="gpu", help="calibration sizes (optimum_dmx.calibration.presets)")
    parser.add_argument("--to", dest="target", choices=list(EXPORT_TARGETS), default="compressed-tensors")
    parser.add_argument("--output", type=Path, help="export folder (default: <model>-<target>)")
    parser.add_argument("--prompt", default="It is a truth universally acknowledged, that")
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()

    dmx_dir = Path(args.model.rstrip("/"))
    if args.calibrate:
        dmx_dir = Path(f"{dmx_dir.name}-dmx{args.target_bits:g}")
        calibrate_for_serving(args.model, args.calibrate, args.target, args.target_bits, args.preset, dmx_dir)
    output = args.output or dmx_dir.with_name(f"{dmx_dir.name}-{args.target}")
    if not (output / "config.json").is_file():
        export_checkpoint(dmx_dir, output, args.target)
    print(f"serving {output} ({args.target})")

    from vllm import LLM, SamplingParams  # imported late: exporting needs no vLLM

    llm = LLM(model=str(output))
    result = llm.generate([args.prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    print(args.prompt + result[0].outputs[0].text)


if __name__ == "__main__":
    main()
