"""The one bounded reader of small JSON files (trainers/jsonfile.py): its size and nesting bounds against the JSON
decoder's own reading."""

import json

import pytest

from trainers.jsonfile import MAX_JSON_DEPTH, nesting_problem, read_small_json


@pytest.mark.parametrize("depth", [0, 1, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 1_000, 100_000])
def test_nesting_is_counted_as_the_decoder_nests(depth):
    """Arrays and objects nested ``depth`` levels: flagged exactly when deeper than the bound."""
    value = 7
    for i in range(min(depth, 900)):  # the decoder itself checks the shallow ones
        value = [value] if i % 2 else {"k": value}
    raw = json.dumps(value).encode() if depth <= 900 else b"[" * depth + b"]" * depth
    assert (nesting_problem(raw) is not None) == (depth > MAX_JSON_DEPTH)


def test_brackets_inside_strings_do_not_count():
    raw = json.dumps({"a": "[{" * 100, "b": ["\\\"[" * 50], "c": '"]}' * 40}).encode()
    assert nesting_problem(raw) is None
    assert nesting_problem(raw, max_depth=1) == "nested more than 1 levels deep"


def test_an_unterminated_string_ends_the_text_without_a_hang():
    raw = b'{"a": "' + b"[" * 200_000
    assert nesting_problem(raw) is None  # the brackets are inside the string; the decoder then says it is not JSON


def test_read_small_json_bounds(tmp_path):
    good = tmp_path / "run.json"
    good.write_text(json.dumps({"run_uid": "x", "n": [1, {"k": None}]}))
    assert read_small_json(good) == {"run_uid": "x", "n": [1, {"k": None}]}
    deep = tmp_path / "deep.json"
    deep.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ValueError, match=r"^deep.json is nested more than 32 levels deep$"):
        read_small_json(deep)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"pad": "x" * 2000}))
    with pytest.raises(ValueError, match=r"^big.json is larger than 1 KiB \(a progress file\)$"):
        read_small_json(big, "a progress file", limit=1 << 10)
    assert read_small_json(big)["pad"] == "x" * 2000
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"a": \xff}')
    with pytest.raises(ValueError):
        read_small_json(bad)
    with pytest.raises(FileNotFoundError):
        read_small_json(tmp_path / "none.json")
