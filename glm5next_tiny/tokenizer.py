"""The tiny checkpoint's tokenizer: a byte-level BPE trained offline on generated text, the
GLM chat format's special tokens and a GLM-style chat template (images included)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Tokens with a fixed meaning in the GLM chat format, plus the multimodal markers the
# config refers to (kept inside the small vocabulary so every config id is valid).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|pad|>",
]

# One image part ({"type": "image"} / {"type": "image_url"}) renders as the image's markers
# around one <|image|>, which vLLM's processor expands to the image's token count
# (glm5next_plugin.multimodal); text renders as before (string content or text parts).
IMAGE_PART = "<|begin_of_image|><|image|><|end_of_image|>"
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "<|{{ message['role'] }}|>\n"
    # no whitespace control from here to the end of the message: the newline above stays
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}" + IMAGE_PART + ""
    "{% endif %}{% endfor %}{% endif %}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>\n{% endif -%}"
)

_WORDS = (
    "the a cache state token prompt model layer block chunk server engine request reply "
    "vector latent pool index sparse dense expert router shared stream gate decay value "
    "key query memory host device prefix suffix resume snapshot boundary hash group "
    "hello world how are you today what is this please tell me about it thank yes no "
    "one two three four five six seven eight nine ten red green blue fast slow small big"
).split()


def _training_corpus(seed: int, num_lines: int = 4000) -> list[str]:
    """Generated text for the tokenizer: words, numbers, punctuation and chat markup."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        n = rng.randint(3, 18)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        line = " ".join(words)
        line = line[0].upper() + line[1:] + rng.choice([".", "?", "!", ",", ":"])
        lines.append(line)
    return lines


def build_tokenizer(seed: int, vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer offline and wrap it as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|pad|>")],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
