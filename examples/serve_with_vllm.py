"""Export a saved dMX model for vLLM and generate with it (needs vLLM and a GPU with MX support for the target).

    python examples/serve_with_vllm.py DMX_DIR [--to compressed-tensors|quark] [--output DIR] [--prompt TEXT]

`compressed-tensors` suits the mxfp8-mxfp4 pair (vLLM serves MXFP4 and MXFP8 through it); `quark` suits the
mxfp6-mxfp4 pair. Calibrate with `DMXConfig(offset_groups="fused", scale_rule=<target>)` so that vLLM can fuse
q/k/v and gate/up and computes exactly what was calibrated. This script is not run by the test suite (no GPU
there); the export itself is tested against the loaders' own code.
"""

import argparse
from pathlib import Path

from optimum_dmx.export import EXPORT_TARGETS, export_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="folder of a saved dMX model")
    parser.add_argument("--to", dest="target", choices=list(EXPORT_TARGETS), default="compressed-tensors")
    parser.add_argument("--output", type=Path, help="export folder (default: <model>-<target>)")
    parser.add_argument("--prompt", default="It is a truth universally acknowledged, that")
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()

    output = args.output or args.model.with_name(f"{args.model.name}-{args.target}")
    if not (output / "config.json").is_file():
        export_checkpoint(args.model, output, args.target)
    print(f"serving {output} ({args.target})")

    from vllm import LLM, SamplingParams  # imported late: exporting needs no vLLM

    llm = LLM(model=str(output))
    result = llm.generate([args.prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    print(args.prompt + result[0].outputs[0].text)


if __name__ == "__main__":
    main()
