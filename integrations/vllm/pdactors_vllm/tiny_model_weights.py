"""How the tiny model is made: its tokenizer (byte-level BPE trained on an embedded corpus), its
config, and its weights from a fixed-seed generator, so that every machine builds the same
model. :mod:`pdactors_vllm.tiny_model` builds it on disk and reads it."""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    DeepseekV2Config,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3NextConfig,
)

__all__ = [
    "BOS",
    "CORPUS",
    "EOS",
    "PAD",
    "UNK",
    "deterministic_weights",
    "model_config",
    "train_tokenizer",
]

_SEED = 20240601
_VOCAB_SIZE = 1024
_INIT_STD = 0.5
# The EOS row of lm_head is scaled up so that EOS wins the argmax for about one input in 400
# (`find_eos_first_prompts` needs some) yet rarely cuts a generation short.
_EOS_ROW_SCALE = 1.1

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
_SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]

_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CORPUS = """\
The prefill engine reads the whole prompt at once and writes the keys and values of every token
into its cache. The decode engine then produces one token at a time, reading that cache again and
again. Splitting the two lets each machine do the kind of work it is good at: prefill is bound by
arithmetic, decode by memory bandwidth. A request that arrives at the proxy goes to a prefill
worker first; when the prompt is done, the blocks of the cache travel over the network to a decode
worker, which continues the answer as if it had computed the prompt itself.

Once upon a time there was a small town by the sea. Every morning the fishermen went out in their
boats, and every evening they came back with baskets full of silver fish. The children ran along
the harbour to meet them, and the old women sat on the benches, talking about the weather, the
price of bread and the news from the city. In the summer the tourists came with their cameras and
their maps, and in the winter the wind blew so hard that nobody left the house without a reason.

A good program is written for people to read and only incidentally for machines to run. Names
should say what a thing does; functions should be short; errors should never pass silently. When
a test fails, read the message before you change the code. When the design is unclear, write down
what you know, what you do not know, and what you would have to measure to find out.

The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore. How much wood
would a woodchuck chuck if a woodchuck could chuck wood? Peter Piper picked a peck of pickled
peppers. Red lorry, yellow lorry. Unique New York. The rain in Spain stays mainly in the plain.

Questions and answers. What is the capital of France? The capital of France is Paris. How many
days are there in a week? There are seven days in a week. What colour is the sky on a clear day?
It is blue. Who wrote the play about the prince of Denmark? William Shakespeare wrote Hamlet.
Why do leaves fall in autumn? The trees stop feeding them to save water through the winter.

Numbers and dates: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve,
twenty, thirty, forty, fifty, one hundred, one thousand. Monday, Tuesday, Wednesday, Thursday,
Friday, Saturday, Sunday. January, February, March, April, May, June, July, August, September,
October, November, December. 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024 3.14 42.

The train leaves the station at half past nine and arrives in the mountains just before noon,
when the snow on the peaks shines brightest. Bring warm clothes, a flask of tea, a good book and
enough patience for the long tunnel under the glacier.
"""


def train_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers' own
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        chat_template=_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )


def model_config(tokenizer: PreTrainedTokenizerFast, shape: dict[str, Any]) -> PretrainedConfig:
    kwargs: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "initializer_range": _INIT_STD,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "dtype": "float32",
        **shape,
    }
    config_classes: dict[str, type[PretrainedConfig]] = {
        "DeepseekV2ForCausalLM": DeepseekV2Config,
        "Qwen3NextForCausalLM": Qwen3NextConfig,
    }
    config_class = config_classes.get(kwargs.get("architectures", [""])[0], LlamaConfig)
    return config_class(**kwargs)


def deterministic_weights(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast
) -> dict[str, torch.Tensor]:
    # Drawn here in sorted-name order from one seeded generator rather than by transformers'
    # initialisers, so the weights do not depend on the transformers version.
    gen = torch.Generator().manual_seed(_SEED)
    state: dict[str, torch.Tensor] = {}
    for name, param in sorted(model.state_dict().items()):
        if name.endswith("norm.weight"):
            state[name] = torch.ones_like(param)
        else:
            state[name] = torch.randn(param.shape, generator=gen, dtype=torch.float32) * _INIT_STD
    head = state["lm_head.weight"]
    # Zero logits lose to the (mostly positive) maximum of the others, so greedy decoding never
    # picks unk/bos/pad or a token that is not printable ASCII: outputs stay readable and
    # detokenize the same incrementally as at once.
    for token_id in range(head.shape[0]):
        if token_id != tokenizer.eos_token_id and not _printable(tokenizer, token_id):
            head[token_id] = 0.0
    head[tokenizer.eos_token_id] *= _EOS_ROW_SCALE
    return state


def _printable(tokenizer: PreTrainedTokenizerFast, token_id: int) -> bool:
    if token_id in tokenizer.all_special_ids:
        return False
    text = tokenizer.decode([token_id])
    return all(c == "\n" or " " <= c <= "~" for c in text)
