"""The character-level tokenizer: ids, round trips, no automatic specials, Hugging Face save/load."""

import pytest
from transformers import AutoTokenizer

from trainers.tokenizer import CHARACTERS, EOS_TOKEN, PAD_TOKEN, build_char_tokenizer, load_tokenizer

PRINTABLE = "".join(chr(c) for c in range(32, 127))


def test_vocabulary_and_special_ids():
    tok = build_char_tokenizer()
    # 5 specials + newline + 95 printable characters.
    assert len(tok) == 101
    assert (tok.pad_token, tok.pad_token_id) == (PAD_TOKEN, 0)
    assert (tok.eos_token, tok.eos_token_id) == (EOS_TOKEN, 1)
    assert tok.bos_token_id is None
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|unk|>"]) == [2, 3, 4]
    # ' ' is code point 32 -> id 6, '~' is 126 -> id 100, '\n' -> 5.
    assert tok.encode(" ~\n", add_special_tokens=False) == [6, 100, 5]
    assert tok.encode("47+38=") == [6 + 52 - 32, 6 + 55 - 32, 6 + 43 - 32, 6 + 51 - 32, 6 + 56 - 32, 6 + 61 - 32]
    assert len(CHARACTERS) == 96


def test_round_trip_of_every_printable_character_and_no_added_specials():
    tok = build_char_tokenizer()
    text = PRINTABLE + "\n" + "  double  spaces\n\nand 12+34=46"
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character, nothing added at either end
    assert tok.eos_token_id not in ids and tok.pad_token_id not in ids
    assert tok.decode(ids) == text
    # Characters outside the vocabulary map to <|unk|> instead of vanishing.
    assert tok.encode("a\u00e9b") == [tok.convert_tokens_to_ids("a"), 4, tok.convert_tokens_to_ids("b")]


def test_specials_in_text_and_skip_on_decode():
    tok = build_char_tokenizer()
    ids = tok.encode("85" + EOS_TOKEN)
    assert ids[-1] == tok.eos_token_id and len(ids) == 3
    assert tok.decode(ids, skip_special_tokens=True) == "85"
    assert tok.decode(ids) == "85" + EOS_TOKEN


def test_save_pretrained_loads_with_auto_tokenizer(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    for loaded in (load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)):
        assert len(loaded) == len(tok)
        assert loaded.encode(PRINTABLE) == tok.encode(PRINTABLE)
        assert loaded.decode(tok.encode(PRINTABLE + "\n")) == PRINTABLE + "\n"
        assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 1)
        batch = loaded(["1+2=", "10+20="], padding=True)
        assert batch["input_ids"][0][:2] == [0, 0]  # left padding
        assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1]


def test_load_tokenizer_missing_path_names_it(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_tokenizer(tmp_path / "empty")
