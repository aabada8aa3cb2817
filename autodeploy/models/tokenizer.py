"""A real byte-level BPE tokenizer, trained deterministically on text that ships with Python.

Presets need a tokenizer that behaves like a user's (special tokens, BOS handling, chat
template, save/load through ``AutoTokenizer``) without any download. The standard library's
``pydoc_data`` topics (~470 kB of English about Python) are always present, and BPE training
on them is deterministic and takes well under a second.
"""

import os
from typing import List

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD, BOS, EOS = "<pad>", "<s>", "</s>"

# A minimal chat template in the tokenizer, so ``apply_chat_template`` works like a chat model's.
# With ``tools`` it shows them in a system turn and asks for Hermes-style calls
# (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, what ``--tool-call-parser hermes``
# reads); an assistant turn's ``tool_calls`` are written back that way. Without tools and calls it
# renders exactly as it did before they were added.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|system|>\nYou may call these functions:\n' }}"
    "{% for tool in tools %}{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}{{ '\n' }}"
    "{% endfor %}"
    "{{ 'To call one, write <tool_call>{\"name\": <its name>, \"arguments\": <an object>}</tool_call>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') }}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def pydoc_corpus() -> List[str]:
    """The standard library's pydoc topics, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def train_bpe_tokenizer(vocab_size: int, corpus: List[str] | None = None) -> Tokenizer:
    """Byte-level BPE with ``vocab_size`` entries at most (fewer if the corpus runs out)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 256 + len(SPECIAL_TOKENS)),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus if corpus is not None else pydoc_corpus(), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def save_tokenizer(tok: Tokenizer, directory: str, model_max_length: int) -> None:
    """Save as a transformers fast tokenizer (``tokenizer.json`` + ``tokenizer_config.json``)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)


def special_token_ids(tok: Tokenizer) -> dict:
    return {"pad_token_id": tok.token_to_id(PAD), "bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS)}
