"""Calibrate a model too large for one device with its weights sharded by FSDP2, then quantize and save it.

    torchrun --nproc_per_node 8 examples/calibrate_sharded.py MODEL --dataset a.txt b.txt --output out
    torchrun --nproc_per_node 2 examples/calibrate_sharded.py MODEL --dataset a.txt --device cpu --preset cpu-demo

1. Every process loads the float model on the CPU in turn (one full copy in CPU memory at a time), shards each
   decoder layer and the model with `fully_shard` onto its device, and drops the full copy: each device holds
   1/N of the weights.
2. `calibrate` learns the format map together (each process takes 1/N of every batch; the offsets' gradients are
   averaged); each decoder layer's weights are gathered for its forward and backward passes and freed after.
3. The first process loads the model again with `device_map="auto"` (what does not fit its device is offloaded)
   and quantizes it with the learned map (`DMXConfig(format_map=...)`; GPTQ rounding by default, layer by layer),
   then saves it. The map is also written to OUTPUT/format_map.json as soon as it is learned.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_dmx import DMXConfig
from optimum_dmx.calibration import build_calibration_batches, calibrate


def sharded_model(model_id: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model with each decoder layer and itself sharded across the processes, loaded one process at a time."""
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    model = None
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype).eval()
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)  # moves the shards and buffers to the mesh's device; the full copy is gone
        dist.barrier()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model folder or Hub id")
    parser.add_argument("--dataset", nargs="+", type=Path, required=True, help="calibration text files")
    parser.add_argument("--target-bits", type=float, default=5.0)
    parser.add_argument("--pair", default="mxfp8-mxfp4", choices=["mxfp8-mxfp4", "mxfp6-mxfp4"])
    parser.add_argument("--preset", default="gpu", help="calibration sizes (optimum_dmx.calibration.presets)")
    parser.add_argument("--steps", type=int, help="override the preset's steps")
    parser.add_argument("--seq-len", type=int, help="override the preset's tokens per sequence")
    parser.add_argument("--batch-size", type=int, help="override the preset's sequences per step (a multiple of N)")
    parser.add_argument("--num-samples", type=int, help="override the preset's calibration sequences")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per process
    dist.init_process_group("nccl" if cuda else "gloo")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sizes = {"preset": args.preset, "seq_len": args.seq_len, "batch_size": args.batch_size}
    sizes["num_samples"] = args.num_samples
    config = DMXConfig(
        target_bits=args.target_bits,
        format_pair=args.pair,
        dataset=args.dataset,
        tokenizer=tokenizer,
        steps=args.steps,
        gradient_checkpointing=True,  # the backward pass gathers each layer again instead of keeping it
        **sizes,
    )
    ids = build_calibration_batches(config.dataset, tokenizer, config.seq_len, config.num_samples, config.seed)
    model = sharded_model(args.model, getattr(torch, args.dtype))
    result = calibrate(model, ids, config.calibration_settings(modules_to_not_convert=["lm_head"]))
    del model
    if dist.get_rank() == 0:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "format_map.json").write_text(json.dumps(result.format_map, indent=1))
        print(f"learned: {result.bits_weighted:.3f} bits by tensor size, {result.bits_simple:.3f} per layer")
        apply = DMXConfig(
            format_map=result.format_map,
            format_pair=args.pair,
            weight_rounding="gptq",  # on the same calibration sequences
            dataset=args.dataset,
            tokenizer=tokenizer,
            **sizes,
        )
        quantized = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=getattr(torch, args.dtype), device_map="auto" if cuda else None, quantization_config=apply
        )
        quantized.save_pretrained(args.output)
        tokenizer.save_pretrained(args.output)
        print(f"saved to {args.output}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
