"""The project's character-level tokenizer for the tiny presets, in Hugging Face format.

One token per printable ASCII character (32..126) plus four special tokens. It is built with the
``tokenizers`` library (a WordLevel model over single characters, each character split off by the
pre-tokenizer, a ``Fuse`` decoder so that decoding concatenates without separators) and wrapped in
``transformers.PreTrainedTokenizerFast``, so ``save_pretrained`` writes a ``tokenizer.json`` that
``AutoTokenizer.from_pretrained`` and vLLM load unchanged.

Ids: 0 ``<|pad|>``, 1 ``<|endoftext|>`` (EOS), 2 ``<|im_start|>``, 3 ``<|im_end|>``, 4 ``<|unk|>``,
5 newline, then the printable characters in code-point order (``' '`` = 6 ... ``'~'`` = 100); 101 ids.
Encoding adds no BOS/EOS: the cold start appends EOS to demonstrations itself and the rollout engine
stops on it. Any other character encodes to ``<|unk|>``, a token no demonstration contains.
"""

from __future__ import annotations

import logging
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from trainers.errors import InputFileNotFoundError
from trainers.jsonfile import read_small_json

log = logging.getLogger(__name__)

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, UNK_TOKEN)
# Newline (for multi-line prompts) and printable ASCII: the whole character vocabulary.
CHARACTERS = ("\n",) + tuple(chr(c) for c in range(32, 127))


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh character-level tokenizer (vocabulary size 101, see the module docstring for the ids)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(CHARACTERS)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Every single character becomes its own "word", spaces and newlines included (isolated, not removed).
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        clean_up_tokenization_spaces=False,
        padding_side="left",
        model_max_length=1 << 20,
    )
    return tok


# Any of these marks a directory that holds a tokenizer (fast, slow BPE, sentencepiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# The JSON files of a tokenizer directory that transformers decodes in Python; tokenizer.json is parsed by the Rust
# tokenizers library, which bounds its own nesting.
TOKENIZER_JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json")
MAX_TOKENIZER_JSON_BYTES = 64 << 20


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load a tokenizer saved in Hugging Face format from a local directory (no hub access).

    The directory must hold one of ``TOKENIZER_FILES`` (transformers would otherwise build an empty
    tokenizer from the model's config.json alone) and the tokenizer must define EOS, which ends every
    response; a missing pad token falls back to EOS with a warning (padding is always masked out).
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise InputFileNotFoundError(f"tokenizer directory not found: {path!r} (model.path must be a local directory "
                                     f"with the weights and the tokenizer)")
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {path!r}: expected one of {', '.join(TOKENIZER_FILES)} "
                                f"(save it there with tokenizer.save_pretrained)")
    try:
        for name in TOKENIZER_JSON_FILES:  # read with Python's recursive decoder by transformers: bounded here first
            if os.path.isfile(os.path.join(path, name)):
                read_small_json(os.path.join(path, name), "a tokenizer's file is at most a few MiB",
                                MAX_TOKENIZER_JSON_BYTES)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, RecursionError) as exc:
        raise FileNotFoundError(f"no loadable tokenizer in {path!r}: {exc}") from exc
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer in {path!r} defines no EOS token: responses could never end")
    if tok.pad_token_id is None:
        log.warning("the tokenizer in %r defines no pad token: padding with EOS (%r)", path, tok.eos_token)
        tok.pad_token = tok.eos_token
    return tok
