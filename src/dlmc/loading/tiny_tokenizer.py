"""A byte-level tokenizer for the built-in tiny checkpoints: id b is byte b, then specials.

Built with the `tokenizers` library and saved in the Hugging Face format (tokenizer.json +
tokenizer_config.json with a LLaDA2-style chat template), so it loads with AutoTokenizer.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<|role_end|>", "<role>", "</role>"]
EOS_ID, MASK_ID = 256, 257
TINY_VOCAB_SIZE = 264  # 256 bytes + 5 specials + 3 reserved

# LLaDA2 template (docs/llada2.md §4): system turn with "detailed thinking off", then the turns.
CHAT_TEMPLATE = (
    "<role>SYSTEM</role>"
    "{%- for m in messages if m['role'] == 'system' %}{{ m['content'] }}\n{%- endfor %}"
    "detailed thinking off<|role_end|>"
    "{%- for m in messages if m['role'] != 'system' %}"
    "<role>{{ 'HUMAN' if m['role'] == 'user' else 'ASSISTANT' }}</role>{{ m['content'] }}"
    "<|role_end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<role>ASSISTANT</role>{%- endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: printable bytes map to themselves, the rest to 256+n."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def write_tiny_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(TINY_VOCAB_SIZE - 256 - len(SPECIAL_TOKENS))]
    core.add_special_tokens(SPECIAL_TOKENS + reserved)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|role_end|>", "<role>", "</role>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
