"""Load a saved dMX model (no recalibration) and generate text with it.

python examples/load_and_generate.py DIR [--prompt "Once upon a time"] [--max-new-tokens 40]
"""

import argparse
from collections import Counter

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import optimum_dmx  # registers the "dmx" quantization method (installed packages also do it automatically)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="folder written by save_pretrained (or a Hub repo id)")
    parser.add_argument("--prompt", default="It is a truth universally acknowledged, that")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    layers = [m for m in model.modules() if isinstance(m, optimum_dmx.MXLinear)]
    counts = Counter(layer.fmt.name for layer in layers)
    print(f"{len(layers)} MX linear layers: " + ", ".join(f"{n} x{c}" for n, c in sorted(counts.items())))

    inputs = tokenizer(args.prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
    print(tokenizer.decode(output[0], skip_special_tokens=True))


if __name__ == "__main__":
    main()
