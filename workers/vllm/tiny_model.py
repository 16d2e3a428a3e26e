"""A tiny Llama-architecture model folder for vLLM with ``--load-format dummy``.

No weights can be downloaded in CI, so tests (and anyone trying the vLLM path on a
laptop) build a model vLLM can serve with random weights: a ``config.json`` and a
byte-level BPE tokenizer trained here on a few sentences, with a chat template that
renders tools, tool calls and tool results, and the ``<tool_call>`` markers vLLM's
hermes tool parser looks for. The text it writes is noise; scheduling, paged KV,
prefix caching, NIXL transfers, ``/tokenize`` and ``/metrics`` are vLLM's own.

    python -m workers.vllm.tiny_model OUT_DIR [--weights]   (needs the `tokenizers` package)

With ``--weights`` it also writes random weights of its own (seeded, larger than
vLLM's dummy ones) to ``model.safetensors``, for tests whose check is what the model
says: vLLM's dummy weights are so small that its greedy answer hardly depends on the
prompt, so a test could not tell KV that holds the prompt from KV that does not.
Those need torch and transformers (vLLM's environment has both).

Sizes are the smallest the CPU attention kernel accepts (head_dim 64).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIALS = ["<s>", "</s>", "<unk>", "<tool_call>", "</tool_call>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|> {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|> "
    "{% if m.content is string %}{{ m.content }}"
    "{% elif m.content %}{% for part in m.content %}{{ part.text }}{% endfor %}{% endif %}"
    "{% for call in m.tool_calls or [] %}<tool_call>"
    '{"name": {{ call.function.name | tojson }}, "arguments": '
    "{% if call.function.arguments is string %}{{ call.function.arguments }}"
    "{% else %}{{ call.function.arguments | tojson }}{% endif %}}</tool_call>{% endfor %}"
    "\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)

CORPUS = [
    "You are a careful agent that plans, calls tools and reads their results.",
    "What is the weather in Paris, Rome, Oslo and Berlin today?",
    "The tool answered: sunny, 24 degrees; cloudy, 18 degrees; snow, minus 3 degrees.",
    "Search the documents for the population of each city and summarise the findings.",
    "Call get_weather with the city name, then answer the user in one sentence.",
    "Round after round the conversation grows: system, user, assistant, tool.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "0 1 2 3 4 5 6 7 8 9 , . : ; ! ? ( ) [ ] { } \" ' - _ / = + *",
]


def build(
    out: Path,
    vocab_size: int = 512,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
) -> Path:
    """The model folder: the tokenizer, its config and chat template, and a Llama ``config.json``
    of these sizes (head_dim 64, the least the CPU attention kernel takes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 4096,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": hidden,
                "intermediate_size": intermediate,
                "num_attention_heads": heads,
                "num_key_value_heads": kv_heads,
                "head_dim": hidden // heads,
                "num_hidden_layers": layers,
                "vocab_size": tokenizer.get_vocab_size(),
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "bos_token_id": tokenizer.token_to_id("<s>"),
                "eos_token_id": tokenizer.token_to_id("</s>"),
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
            },
            indent=2,
        )
    )
    return out


def write_weights(out: Path, seed: int = 0, std: float = 0.2) -> Path:
    """Seeded random weights for the model ``build`` wrote to ``out``, as vLLM loads them."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig.from_pretrained(out)
    config.initializer_range = std
    model = LlamaForCausalLM(config)
    path = out / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path), metadata={"format": "pt"})
    return path


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
    if "--weights" in sys.argv[2:]:
        print(write_weights(Path(sys.argv[1])))
