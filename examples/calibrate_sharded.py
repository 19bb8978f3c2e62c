"""Calibrate a model too large for one device with its weights sharded by FSDP2, then quantize and save it.

    torchrun --nproc_per_node 8 examples/calibrate_sharded.py MODEL --dataset a.txt b.txt --output out
    torchrun --nproc_per_node 2 examples/calibrate_sharded.py MODEL --dataset a.txt --device cpu --preset cpu-demo
    torchrun --nproc_per_node 8 examples/calibrate_sharded.py MODEL --dataset a.txt --rotation hadamard \
        --learn-rotations --output out

1. Every process loads the float model on the CPU in turn (one full copy in CPU memory at a time), turns a mixture
   of experts' packed experts into linears (`optimum_dmx.nn.linearize_experts`), rotates it if asked (before
   sharding: the online transform of `down_proj` replaces that module), shards each decoder layer and the model
   with `fully_shard` onto its device, and drops the full copy: each device holds 1/N of the weights.
2. `calibrate` learns the format map together (each process takes 1/N of every batch; the offsets' gradients are
   averaged, and with `--learn-rotations` the rotations' too, merged into the shards at the end); each decoder
   layer's weights are gathered for its forward and backward passes and freed after.
3. The first process loads the model again with `device_map="auto"` (what does not fit its device is offloaded),
   rotates it the same way and, with learned rotations, writes the learned weights into it from the shards
   (gathered to its CPU memory), then quantizes it with the learned map (`DMXConfig(format_map=...)`; GPTQ rounding
   by default, layer by layer) and saves it. The map is also written to OUTPUT/format_map.json as soon as it is
   learned.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_dmx import DMXConfig, DMXQuantizer
from optimum_dmx.calibration import build_calibration_batches, calibrate
from optimum_dmx.nn import linear_modules_to_quantize, linearizable_experts, linearize_experts
from optimum_dmx.nn.placement import write_parameters
from optimum_dmx.nn.rotation import rotate_model


def prepared(model: torch.nn.Module, config: DMXConfig) -> torch.nn.Module:
    """`model` with a mixture of experts' packed experts as linears (`nn.experts`), rotated as `config` asks (the
    same matrices in every process and every load: seeded)."""
    linearize_experts(model, linearizable_experts(model, ["lm_head"]))
    quantized = list(linear_modules_to_quantize(model, ["lm_head"]))
    rotate_model(model, config.rotation, quantized, config.block_size, config.seed)
    return model


def sharded_model(model_id: str, dtype: torch.dtype, config: DMXConfig) -> torch.nn.Module:
    """The model, rotated, with each decoder layer and itself sharded across the processes, loaded one process at a
    time."""
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    model = None
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            model = prepared(AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype).eval(), config)
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
    parser.add_argument("--rotation", default="none", choices=["none", "hadamard", "block_hadamard"])
    parser.add_argument("--learn-rotations", action="store_true", help="train the rotations with the formats")
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
        rotation=args.rotation,
        learn_rotations=args.learn_rotations,
        gradient_checkpointing=True,  # the backward pass gathers each layer again instead of keeping it
        **sizes,
    )
    ids = build_calibration_batches(config.dataset, tokenizer, config.seq_len, config.num_samples, config.seed)
    model = sharded_model(args.model, getattr(torch, args.dtype), config)
    result = calibrate(model, ids, config.calibration_settings(modules_to_not_convert=["lm_head"]))
    learned = None
    if args.learn_rotations:  # every process takes part; the first one gets the whole weights in its CPU memory
        learned = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
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
        quantized = prepared(
            AutoModelForCausalLM.from_pretrained(
                args.model, dtype=getattr(torch, args.dtype), device_map="auto" if cuda else None
            ),
            config,
        )
        for key, value in (learned or {}).items():  # where each weight lives: on a device or offloaded
            module_name, name = key.rsplit(".", 1)
            write_parameters(quantized, module_name, {name: value})
        DMXQuantizer(apply).quantize_model(quantized, tokenizer)  # records the online transforms of the rotation
        quantized.save_pretrained(args.output)
        tokenizer.save_pretrained(args.output)
        print(f"saved to {args.output}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
