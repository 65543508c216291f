"""A byte-level tokenizer with Gemma 4's special ids, for the built-in `tiny-diffusiongemma`.

Ids 0..255 are special tokens (pad 0, `<eos>` 1, `<bos>` 2, the stop id 50, the turn markers
105 / 106, the rest unused), byte b is id 256 + b, and the image placeholders follow the bytes.
Saved in the Hugging Face format with a Gemma 4 chat template, so it loads with AutoTokenizer.
"""

from __future__ import annotations

from pathlib import Path

from dlmc.loading.tiny_tokenizer import _bytes_to_unicode

PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
TOOL_RESPONSE_ID = 50  # the generation config's third stop id (`<|tool_response>`)
TURN_OPEN_ID, TURN_CLOSE_ID = 105, 106
BYTE_OFFSET = 256
BOI_ID, EOI_ID, IMAGE_ID = 512, 513, 514
TINY_GEMMA_VOCAB_SIZE = 520
SPECIALS = {
    PAD_ID: "<pad>", EOS_ID: "<eos>", BOS_ID: "<bos>", 3: "<unk>",
    TOOL_RESPONSE_ID: "<|tool_response>", 100: "<|channel>", 101: "<channel|>",
    TURN_OPEN_ID: "<|turn>", TURN_CLOSE_ID: "<turn|>",
    BOI_ID: "<|image>", EOI_ID: "<image|>", IMAGE_ID: "<|image|>",
}

# Gemma 4: `<bos><|turn>system\n...<turn|>\n<|turn>user\n...<turn|>\n<|turn>model\n`.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<turn|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def special_vocab() -> dict[int, str]:
    """Every non-byte id's token: the named specials, `<unused_i>` for the rest."""
    byte_ids = range(BYTE_OFFSET, BYTE_OFFSET + 256)
    return {i: SPECIALS.get(i, f"<unused_{i}>") for i in range(TINY_GEMMA_VOCAB_SIZE)
            if i not in byte_ids}


def write_tiny_gemma_tokenizer(directory: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with the chat template) into `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = special_vocab()
    vocab = {char: BYTE_OFFSET + byte for byte, char in _bytes_to_unicode().items()}
    vocab.update({token: i for i, token in specials.items()})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([specials[i] for i in sorted(specials)])  # keeps the vocab ids
    # `add_special_tokens=True` prepends <bos>, as Gemma's tokenizer does
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS_ID)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
