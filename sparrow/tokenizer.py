"""Tiny tokenizers built in code (no downloads), with the real chat templates and vision
special tokens of the model families Sparrow serves.

A byte-level BPE trained on a small built-in corpus: every string round-trips, the special
tokens are single ids, and the result saves/loads through `save_pretrained`/`AutoTokenizer`
like any Hugging Face tokenizer.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# The Qwen2-VL / Qwen2.5-VL chat format: typed content lists, a video becomes
# <|vision_start|><|video_pad|><|vision_end|> (the processor expands <|video_pad|>).
QWEN_VL_CHAT_TEMPLATE = (
    "{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'image' or 'image' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# LLaVA-OneVision (Qwen2 language model): the video placeholder is <video> followed by a newline.
LLAVA_OV_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'video' %}<video>\n"
    "{% elif content['type'] == 'image' %}<image>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN_VL_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|image_pad|>",
)
LLAVA_OV_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<video>", "<image>")

_CORPUS = """\
You are a helpful assistant. What happens in the video? Describe the video in detail.
A red square appears on the left and moves to the right. The blue circle changes colour to green.
A yellow triangle disappears at the end. How many shapes are there? Which shape moves first?
The video shows moving coloured shapes on a dark background. First, then, after that, finally.
What colour is the circle when the video ends? Where does the square go? When does it appear?
There are two shapes: one square and one circle. The square is red, the circle is blue.
Yes. No. Left, right, up, down, top, bottom, centre, middle, corner, edge, fast, slow.
one two three four five six seven eight nine ten seconds frames minute start end begin
red green blue yellow white black purple orange cyan magenta grey pink brown
"""


def build_tokenizer(special_tokens: tuple[str, ...], chat_template: str, vocab_size: int = 512,
                    eos_token: str = "<|im_end|>") -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the built-in corpus (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token="<|endoftext|>")
    fast.chat_template = chat_template
    return fast


def qwen_vl_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    return build_tokenizer(QWEN_VL_SPECIAL_TOKENS, QWEN_VL_CHAT_TEMPLATE, vocab_size)


def llava_ov_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    return build_tokenizer(LLAVA_OV_SPECIAL_TOKENS, LLAVA_OV_CHAT_TEMPLATE, vocab_size)
