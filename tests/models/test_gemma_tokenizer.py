"""kvlm's SentencePiece tokenizer ("llama" in GGUF): the real Gemma 3 270M file against transformers' tokenizer
for the same file, and small made-up vocabularies against llama.cpp's own algorithm.

One known difference from llama.cpp: Gemma's runs of 2 to 31 spaces are single pieces, which llama.cpp matches
whole before anything else, while transformers (and kvlm, following it) joins them from single spaces like any
piece. Both give one piece for up to 31 spaces; a longer run is cut differently (40 spaces: 31 + 9 in llama.cpp,
16 + 24 here).
"""
from __future__ import annotations

import re

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlm.core.errors import ModelFileError
from kvlm.families import gemma3
from kvlm.text.tokenizer import StreamDecoder, Tokenizer

SPACE = "\u2581"
BOS, EOS, START_OF_TURN, END_OF_TURN, NEWLINE = 2, 1, 105, 106, 107
BYTE_PIECES = range(238, 494)  # <0x00> .. <0xFF> in Gemma 3's vocabulary

TEXTS = [
    "",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing spaces   ",
    "  two leading, then a   b    c     d",
    " " * 31,
    "x" + " " * 40 + "y",
    "\t\tindented with tabs\n\n\nthree newlines" + "\n" * 34 + "many" + "\t" * 35 + "tabs",
    " \n \n  \t\n\r\n\r\n",
    "def reverse(s: str) -> str:\n    \"\"\"Reverse s.\"\"\"\n    return s[::-1]\n\n\n"
    "class A:\n\tdef f(self):\n\t\tpass\n        deep = {'k': [1, 2]}\n",
    "日本語のテキスト，中文文本。한국어 텍스트",
    "emoji 😀👍🏽🇫🇷 and ZWJ 👨‍👩‍👧‍👦 🏳️‍🌈 🧑🏾‍💻",
    "héllo wörld, ça va? naïve façade Ångström œuvre",
    "1234567 3.14159 1,000,000 -42 1e10 0x1F 2024-06-01",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user\n  spaced  <end_of_turn>\n",
    "text<eos>more<pad>",
    "<start_of_turn without end <end_of_turn",
    "<b>bold</b> <table><tr><td>cell</td></tr></table> <h1>",
    "rare: \U000e0001 \U00010348 \u0bf5 \U00011000 𓀀 ꙮ 𪛖 \x07",
    "\u00a0non-breaking\u2003em space\u200bzero width",
    "<0x41> is not a byte",
]

# Pieces hypothesis mixes into random text, so that it meets special tokens, whitespace runs and rare characters.
PIECES = st.sampled_from(
    ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<b>", " ", "  ", "    ", " " * 33, "\n", "\n\n", "\t",
     "\t\t", "\r\n", "123", "😀", "👨‍👩‍👧", "日本", "é", "\U000e0001", "𐍈", "def "]
)
RANDOM_TEXT = st.lists(st.one_of(st.text(max_size=16), PIECES), max_size=12).map("".join)


def _stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    decoder = StreamDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
    return [*(decoder.feed(i) for i in ids), decoder.flush()]


# --- the real Gemma 3 file ---

def test_properties(tokenizer, metadata, hf_gemma_tokenizer):
    assert metadata["tokenizer.ggml.model"] == "llama" and metadata["general.architecture"] == "gemma3"
    assert metadata["tokenizer.ggml.add_space_prefix"] is False and metadata["tokenizer.ggml.add_bos_token"] is True
    assert tokenizer.vocab_size == len(hf_gemma_tokenizer) == 262144
    assert (tokenizer.bos_id, tokenizer.eos_id) == (hf_gemma_tokenizer.bos_token_id, hf_gemma_tokenizer.eos_token_id)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (BOS, EOS)
    # The file names no end-of-turn token; <end_of_turn> stops generation by its text, as in llama.cpp.
    assert "tokenizer.ggml.eot_token_id" not in metadata
    assert tokenizer.stop_ids == frozenset({EOS, END_OF_TURN})


def test_the_base_model_file_has_no_chat_template_and_gets_gemmas(tokenizer, metadata):
    """Gemma 3's built-in template (tests/models/test_gemma_chat.py checks it against transformers)."""
    assert "tokenizer.chat_template" not in metadata and tokenizer.chat_template == gemma3.CHAT_TEMPLATE


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, hf_gemma_tokenizer, text):
    assert tokenizer.encode(text) == hf_gemma_tokenizer.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == hf_gemma_tokenizer.encode(text, add_special_tokens=False)


@settings(max_examples=300, deadline=None)
@given(text=RANDOM_TEXT)
def test_encode_matches_transformers_on_random_text(tokenizer, hf_gemma_tokenizer, text):
    assert tokenizer.encode(text) == hf_gemma_tokenizer.encode(text)


def test_bos_is_added_and_special_tokens_in_text_are_single_ids(tokenizer):
    ids = tokenizer.encode("<start_of_turn>user\nhi<end_of_turn>\n")
    assert ids == [BOS, START_OF_TURN, 2364, NEWLINE, 2202, END_OF_TURN, NEWLINE]
    assert tokenizer.encode("", add_special_tokens=False) == [] and tokenizer.encode("") == [BOS]


def test_no_space_is_put_before_the_text(tokenizer, metadata):
    tokens = metadata["tokenizer.ggml.tokens"]
    assert [tokens[i] for i in tokenizer.encode("hi", add_special_tokens=False)] == ["hi"]
    assert [tokens[i] for i in tokenizer.encode(" hi", add_special_tokens=False)] == [f"{SPACE}hi"]


def test_runs_of_spaces_tabs_and_newlines_are_single_pieces(tokenizer):
    for run in (" " * 2, " " * 31, "\t" * 7, "\n" * 12):
        assert len(tokenizer.encode(f"a{run}b", add_special_tokens=False)) == 3


def test_space_runs_longer_than_a_piece_are_cut_as_transformers_cuts_them(tokenizer):
    """Pins the difference from llama.cpp described at the top (there: 31 + 9 spaces)."""
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(" " * 40, add_special_tokens=False)]
    assert pieces == [" " * 16, " " * 24]


def test_characters_outside_the_vocabulary_fall_back_to_bytes(tokenizer):
    ids = tokenizer.encode("a\U00010348", add_special_tokens=False)
    assert len(ids) == 5 and all(i in BYTE_PIECES for i in ids[1:])
    assert tokenizer.decode(ids) == "a\U00010348"
    assert b"".join(tokenizer.token_bytes(i) for i in ids[1:]) == "\U00010348".encode("utf-8")


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers_and_round_trips(tokenizer, hf_gemma_tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_gemma_tokenizer.decode(
            ids, skip_special_tokens=skip)


def test_a_written_sentencepiece_space_decodes_as_a_space_as_in_transformers(tokenizer, hf_gemma_tokenizer):
    ids = tokenizer.encode(f"{SPACE}x", add_special_tokens=False)
    assert tokenizer.decode(ids) == hf_gemma_tokenizer.decode(ids) == " x"


@settings(max_examples=200, deadline=None)
@given(text=RANDOM_TEXT)
def test_decode_and_stream_round_trip_on_random_text(tokenizer, text):
    text = text.replace(SPACE, " ")
    ids = tokenizer.encode(text)
    pieces = _stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == "<bos>" + text
    if "\ufffd" not in text:  # (a replacement character in the text itself streams as one)
        assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_put_back_together_give_the_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_stream_decoder_holds_back_a_character_split_over_byte_pieces(tokenizer):
    ids = tokenizer.encode("\U00010348!", add_special_tokens=False)
    decoder = StreamDecoder(tokenizer)
    assert [decoder.feed(i) for i in ids] == ["", "", "", "\U00010348", "!"]
    assert "".join(_stream(tokenizer, [START_OF_TURN, *ids], skip_special_tokens=True)) == "\U00010348!"


def test_stream_decoder_flush_gives_an_incomplete_character(tokenizer):
    first_byte = tokenizer.encode("\U00010348", add_special_tokens=False)[0]
    decoder = StreamDecoder(tokenizer)
    assert decoder.feed(first_byte) == ""
    assert decoder.flush() == "\ufffd"
    assert decoder.feed(tokenizer.encode(" a", add_special_tokens=False)[0]) == " a"


# --- made-up vocabularies against llama.cpp's algorithm ---

UNK, S, END = "<unk>", "<s>", "</s>"
BYTES = [f"<0x{b:02X}>" for b in range(256)]
# (piece, score): the file order is not the score order, so a tokenizer ranking pieces by position would differ.
NORMAL = [(SPACE, -1.0), ("a", -2.0), ("b", -3.0), ("c", -4.0), ("d", -5.0), ("ab", -20.0), ("bc", -10.0),
          (f"{SPACE}a", -11.0), (f"{SPACE}b", -12.0), ("cd", -13.0), ("cab", -14.0), ("dd", -15.0),
          (f"{SPACE}{SPACE}", -16.0), ("bcd", -17.0), ("é", -18.0), (f"{SPACE}é", -19.0), ("bcab", -21.0)]
CONTROL, USER_DEFINED = "<ctl>", "<ud>"
SYNTHETIC_TOKENS = [UNK, S, END, *BYTES, *(piece for piece, _ in NORMAL), CONTROL, USER_DEFINED]
ID = {token: i for i, token in enumerate(SYNTHETIC_TOKENS)}


def synthetic_metadata(**overrides) -> dict:
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": SYNTHETIC_TOKENS,
        "tokenizer.ggml.scores": [0.0] * (3 + len(BYTES)) + [score for _, score in NORMAL] + [-1000.0, -1000.0],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * len(BYTES) + [1] * len(NORMAL) + [3, 4],
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_space_prefix": False,
        **overrides,
    }


def llama_cpp_tokenize(metadata: dict, text: str) -> list[int]:
    """llama.cpp's llama_vocab::impl::tokenize for an SPM vocabulary (src/llama-vocab.cpp), written out plainly.

    Special tokens cut the text first. With add_space_prefix, a space goes before each fragment that starts the
    text or follows a special token. A fragment is split into characters, and the adjacent pair making the
    best-scored piece joins, the leftmost on a tie, until no pair makes a piece; what is no piece goes out as
    <0xNN> bytes.
    """
    tokens, scores = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"]
    ids = {token: i for i, token in enumerate(tokens)}
    specials = [t for t, kind in zip(tokens, metadata["tokenizer.ggml.token_type"]) if kind in (2, 3, 4)]
    prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    out, after_special = [ids[S]], True
    for fragment in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        if fragment in specials:
            out.append(ids[fragment])
            after_special = True
        elif fragment:
            out += _spm_fragment(ids, scores, (" " if prefix and after_special else "") + fragment)
            after_special = False
    return out


def _spm_fragment(ids: dict[str, int], scores: list[float], text: str) -> list[int]:
    symbols = list(text.replace(" ", SPACE))
    while True:
        pairs = [i for i in range(len(symbols) - 1) if symbols[i] + symbols[i + 1] in ids]
        if not pairs:
            break
        best = max(pairs, key=lambda i: (scores[ids[symbols[i] + symbols[i + 1]]], -i))
        symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
    return [i for s in symbols for i in ([ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()])]


SYNTHETIC_TEXT = st.lists(
    st.sampled_from(["a", "b", "c", "d", " ", "  ", "é", "😀", "x", CONTROL, USER_DEFINED, "abcab"]), max_size=16
).map("".join)


def _pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return [SYNTHETIC_TOKENS[i] for i in tokenizer.encode(text, add_special_tokens=False)]


def test_the_pair_making_the_best_scored_piece_joins_first():
    tokenizer = Tokenizer.from_gguf_metadata(synthetic_metadata())
    # "ab" comes first in the file, but "bc" scores better.
    assert _pieces(tokenizer, "abc") == ["a", "bc"]
    assert _pieces(tokenizer, "cab") == ["cab"]  # "ca" is no piece, so "ab" joins first, then "cab"
    assert _pieces(tokenizer, "abcab") == ["a", "bcab"]  # a|bc|a|b, then a|bc|ab, then a|bcab
    assert _pieces(tokenizer, "a bcd") == ["a", SPACE, "bcd"]  # "bc" beats "▁b"; then "bcd", as "▁bc" is no piece


def test_characters_outside_a_made_up_vocabulary_fall_back_to_bytes():
    tokenizer = Tokenizer.from_gguf_metadata(synthetic_metadata())
    assert _pieces(tokenizer, "aüé") == ["a", "<0xC3>", "<0xBC>", "é"]
    assert tokenizer.decode(tokenizer.encode("aüé")) == "<s>aüé"
    assert tokenizer.token_bytes(tokenizer.encode("ü", add_special_tokens=False)[0]) == b"\xc3"


@pytest.mark.parametrize("add_space_prefix", [False, True])
@settings(max_examples=300, deadline=None)
@given(text=SYNTHETIC_TEXT)
def test_made_up_vocabulary_matches_llama_cpp(add_space_prefix, text):
    metadata = synthetic_metadata(**{"tokenizer.ggml.add_space_prefix": add_space_prefix})
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    assert tokenizer.encode(text) == llama_cpp_tokenize(metadata, text)
    if add_space_prefix and (CONTROL in text or USER_DEFINED in text):
        return  # the spaces put after special tokens stay in the decoded text, as in llama.cpp
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_space_prefix_is_llama_cpp_s_default():
    metadata = synthetic_metadata()
    del metadata["tokenizer.ggml.add_space_prefix"]
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    assert _pieces(tokenizer, "a a") == [f"{SPACE}a", f"{SPACE}a"]
    assert _pieces(tokenizer, f"{CONTROL}a") == [CONTROL, f"{SPACE}a"]
    assert tokenizer.decode(tokenizer.encode("a a", add_special_tokens=False)) == "a a"


def test_bos_is_added_unless_the_file_says_not_to():
    assert Tokenizer.from_gguf_metadata(synthetic_metadata()).encode("a") == [ID[S], ID["a"]]
    no_bos = Tokenizer.from_gguf_metadata(synthetic_metadata(**{"tokenizer.ggml.add_bos_token": False}))
    assert no_bos.encode("a") == [ID["a"]]
    with_eos = Tokenizer.from_gguf_metadata(synthetic_metadata(**{"tokenizer.ggml.add_eos_token": True}))
    assert with_eos.encode("a") == [ID[S], ID["a"], ID[END]]


def test_stop_ids_take_the_end_of_turn_token_from_the_metadata_or_its_text():
    metadata = synthetic_metadata()
    for key, value in (("tokens", "<end_of_turn>"), ("scores", 0.0), ("token_type", 3)):
        metadata[f"tokenizer.ggml.{key}"] = [*metadata[f"tokenizer.ggml.{key}"], value]
    end_of_turn = len(SYNTHETIC_TOKENS)
    assert Tokenizer.from_gguf_metadata(metadata).stop_ids == frozenset({ID[END], end_of_turn})
    marked = {**metadata, "tokenizer.ggml.eot_token_id": ID[CONTROL]}
    assert Tokenizer.from_gguf_metadata(marked).stop_ids == frozenset({ID[END], ID[CONTROL], end_of_turn})


# --- errors ---

def test_an_unknown_tokenizer_model_is_named_with_the_supported_ones():
    with pytest.raises(ModelFileError, match="'bert'.*'gpt2'.*'llama'"):
        Tokenizer.from_gguf_metadata(synthetic_metadata(**{"tokenizer.ggml.model": "bert"}))


def test_missing_scores_are_named():
    metadata = synthetic_metadata()
    del metadata["tokenizer.ggml.scores"]
    with pytest.raises(ModelFileError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata(metadata)


def test_scores_of_another_length_are_refused():
    metadata = synthetic_metadata()
    with pytest.raises(ModelFileError, match=f"3 tokenizer.ggml.scores for {len(SYNTHETIC_TOKENS)} tokens"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.scores": [0.0, 0.0, 0.0]})
