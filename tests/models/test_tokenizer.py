"""kvlm.text.tokenizer against the tokenizer transformers builds from the same GGUF file.

One known difference: transformers' GGUF loader has no entry for the "smollm" pre-tokenizer and falls
back to GPT-2's regex, while SmolLM's own tokenizer.json (and llama.cpp) first cut out every numeral on
its own. The two only disagree on whitespace right before a numeral: two or more whitespace characters,
or a space before a numeral outside ASCII (e.g. "x  1", "\r\n0", "5 ½"). kvlm follows the model's own
tokenizer, so every text is compared with transformers' tokenizer carrying SmolLM's pre-tokenizer, and
texts without that pattern with transformers' tokenizer exactly as it is.
"""
from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend

from kvlm.core.errors import KvlmError, ModelFileError
from kvlm.loader.gguf_reader import read_gguf_metadata
from kvlm.text.tokenizer import StreamDecoder, Tokenizer

transformers = pytest.importorskip("transformers")

# From SmolLM2's tokenizer.json.
SMOLLM_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}

TEXTS = [
    "",
    "Hello, world!",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "whitespace   runs \t\t tabs\n\n\nnewlines\r\nand CRLF \n \n",
    "héllo wörld, ça va? naïve façade Ångström",
    "emoji 😀👍🏽🇫🇷🏳️‍🌈 and more 🤖",
    "日本語のテキスト，中文文本。한국어 텍스트",
    "Привет, мир! Γειά σου κόσμε! مرحبا بالعالم",
    "digits 0 12 123 1234567890 3.14159 -42 1e10 0x1F",
    "a long number 98765432109876543210 and 1,000,000.00",
    "x  1 and 5 ½ cups, E = mc ²",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))\n",
    'if (x != y && z >= 10) { console.log("ok"); }',
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<repo_name>x<file_sep>",
    "<|im_start|> spaced <|im_end|> tokens ",
    "<|im_start|without end",
    "I'm sure you're right, they've said we'll go, I'd say it's DON'T",
    "\u00a0non-breaking\u2003em space\u200bzero width\ufeffbom",
    "control \x00\x01\x1f chars",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Arr, ahoy!"},
        {"role": "user", "content": "Where is the treasure? 🏴‍☠️"},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second"},
        {"role": "user", "content": "  third, with spaces and\nnewlines\n"},
    ],
    [{"role": "user", "content": "quotes \" ' and <b>html</b> & ünïcödé"}],
]

# Exercises what transformers' template environment adds to plain jinja2.
FEATURE_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(count=0) %}"
    "{% for message in messages %}"
    "  {% if message.role == 'stop' %}{% break %}{% endif %}"
    "  {% set ns.count = ns.count + 1 %}"
    "  {% generation %}{{ message.role }}={{ message | tojson }}{% endgeneration %}\n"
    "{% endfor %}"
    "{{ ns.count }} {{ dict(a='é', b=[1, 2]) | tojson }} {{ 'x' | tojson(indent=2) }}"
    "{% if tools is none and documents is none %} no-tools{% endif %}"
    "{{ eos_token }}{{ pad_token }}{{ unk_token }}"
    "{% if add_generation_prompt %}<go>{% endif %}"
)
FEATURE_MESSAGES = [
    {"role": "system", "content": "<b>bold</b> & 'quoted' é 日本"},
    {"role": "user", "content": "hi", "name": None},
    {"role": "assistant", "content": "ok", "reasoning_content": "thought about it"},
    {"role": "stop", "content": "never shown"},
    {"role": "user", "content": "unreached"},
]

# Pieces hypothesis mixes into random text, so that it meets special tokens, whitespace and numerals often.
PIECES = st.sampled_from(
    ["<|im_start|>", "<|im_end|>", "<|endoftext|>", " ", "  ", "\n", "\t", "\r\n", "123", " 45", "½", "😀", "é", "日本"]
)
RANDOM_TEXT = st.lists(st.one_of(st.text(max_size=16), PIECES), max_size=12).map("".join)


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    home = Path(os.environ.get("KVLM_HOME", Path.home() / ".cache" / "kvlm"))
    path = home / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"model file not downloaded: {path}")
    return path


@pytest.fixture(scope="module")
def metadata(smollm2_gguf_path: Path) -> dict:
    return read_gguf_metadata(smollm2_gguf_path)


@pytest.fixture(scope="module")
def tokenizer(metadata: dict) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.fixture(scope="module")
def reference(smollm2_gguf_path: Path):
    """transformers' tokenizer for the same GGUF file."""
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)


@pytest.fixture(scope="module")
def smollm_reference(reference) -> Backend:
    """transformers' GGUF tokenizer with the pre-tokenizer of SmolLM's own tokenizer.json."""
    return _with_pre_tokenizer(reference, SMOLLM_PRE_TOKENIZER)


def _with_pre_tokenizer(reference, pre_tokenizer: dict) -> Backend:
    spec = json.loads(reference.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = pre_tokenizer
    return Backend.from_str(json.dumps(spec))


def _transformers_smollm_gap(text: str) -> bool:
    """Whether `text` has whitespace before a numeral that GPT-2's regex alone cuts differently."""
    for i, char in enumerate(text[1:], start=1):
        if not unicodedata.category(char).startswith("N") or not text[i - 1].isspace():
            continue
        if (i > 1 and text[i - 2].isspace()) or (text[i - 1] == " " and not char.isascii()):
            return True
    return False


def _assert_same_ids(tokenizer: Tokenizer, reference, smollm_reference: Backend, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == smollm_reference.encode(text).ids
    if not _transformers_smollm_gap(text):
        assert ids == reference.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, reference, smollm_reference, text):
    _assert_same_ids(tokenizer, reference, smollm_reference, text)


@settings(max_examples=200, deadline=None)
@given(text=RANDOM_TEXT)
def test_encode_matches_transformers_on_random_text(tokenizer, reference, smollm_reference, text):
    _assert_same_ids(tokenizer, reference, smollm_reference, text)


def test_digits_are_split_one_by_one(tokenizer):
    assert len(tokenizer.encode("123")) == 3
    assert len(tokenizer.encode("98765432109876543210")) == 20


def test_transformers_smollm_difference_is_the_known_one(tokenizer, reference, smollm_reference):
    """Pins the difference documented at the top; if transformers fixes it, the workaround can go."""
    for text in ["x  1", "\r\n0", "5 ½ cups"]:
        assert tokenizer.encode(text) == smollm_reference.encode(text).ids
        assert tokenizer.encode(text) != reference.encode(text)


def test_special_tokens_in_text_are_single_ids(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.bos_id == 1
    assert ids[-1] == tokenizer.eos_id == 2


def test_no_bos_added_when_the_file_says_not_to(tokenizer):
    assert tokenizer.encode("hello")[0] != tokenizer.bos_id
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_special_tokens=False)


def test_bos_added_when_the_file_asks(metadata):
    asks = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.add_bos_token": True})
    assert asks.encode("hello") == [asks.bos_id, *asks.encode("hello", add_special_tokens=False)]


def test_properties(tokenizer, reference):
    assert tokenizer.vocab_size == len(reference) == 49152
    assert (tokenizer.bos_id, tokenizer.eos_id) == (reference.bos_token_id, reference.eos_token_id)
    assert tokenizer.stop_ids == frozenset({0, 2})  # <|im_end|> (eos) and, as in llama.cpp, <|endoftext|>


def test_stop_ids_include_end_of_turn_tokens(metadata):
    marked = {**metadata, "tokenizer.ggml.eot_token_id": 1, "tokenizer.ggml.eom_token_id": 4}
    assert Tokenizer.from_gguf_metadata(marked).stop_ids == frozenset({0, 1, 2, 4})


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers_and_round_trips(tokenizer, reference, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None)
@given(text=RANDOM_TEXT)
def test_decode_round_trips_on_random_text(tokenizer, text):
    # A few bytes (some control characters, lead bytes of planes 4-11) have no token and are dropped.
    text = "".join(char for char in text if tokenizer.decode(tokenizer.encode(char)) == char)
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, reference, messages, add_generation_prompt):
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_environment_matches_transformers(metadata, reference, add_generation_prompt):
    tokenizer = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template": FEATURE_TEMPLATE})
    expected = reference.apply_chat_template(
        FEATURE_MESSAGES, chat_template=FEATURE_TEMPLATE, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.apply_chat_template(FEATURE_MESSAGES, add_generation_prompt=add_generation_prompt) == expected


def test_template_can_raise(metadata):
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('must start with user') }}{% endif %}"
    tokenizer = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template": template})
    with pytest.raises(jinja2.TemplateError, match="must start with user"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_sandbox_refuses_internals(metadata):
    template = "{% set ns = namespace() %}{% set ns._hidden = 1 %}"
    tokenizer = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template": template})
    with pytest.raises(jinja2.exceptions.SecurityError):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template_is_a_clear_error(metadata):
    without = {key: value for key, value in metadata.items() if key != "tokenizer.chat_template"}
    with pytest.raises(KvlmError, match="no chat template"):
        Tokenizer.from_gguf_metadata(without).apply_chat_template([{"role": "user", "content": "hi"}])


STREAM_TEXTS = [
    "emoji 😀👍🏽🇫🇷🏳️‍🌈🤖 end",
    "héllo wörld — “quotes” 日本語のテキスト 한국어",
    "<|im_start|>assistant\n½ ² 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🏴‍☠️<|im_end|>",
]


def _stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    decoder = StreamDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
    return [decoder.feed(token_id) for token_id in ids] + [decoder.flush()]


def test_stream_test_texts_split_characters_across_tokens(tokenizer):
    for text in STREAM_TEXTS:
        assert any("\ufffd" in tokenizer.decode([token_id]) for token_id in tokenizer.encode(text))


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_decoder_never_emits_half_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces = _stream(tokenizer, ids)
    assert not any("\ufffd" in piece for piece in pieces)
    assert pieces[-1] == ""
    assert "".join(pieces) == tokenizer.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(text=RANDOM_TEXT)
def test_stream_decoder_on_random_text(tokenizer, text):
    ids = tokenizer.encode(text)
    pieces = _stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids)
    if "\ufffd" not in tokenizer.decode(ids):
        assert not any("\ufffd" in piece for piece in pieces)


def test_stream_decoder_skips_special_tokens(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nhi 😀<|im_end|>")
    assert "".join(_stream(tokenizer, ids, skip_special_tokens=True)) == "assistant\nhi 😀"


def test_stream_decoder_flush_gives_an_incomplete_character(tokenizer):
    first_byte = tokenizer.encode("😀")[0]
    decoder = StreamDecoder(tokenizer)
    assert decoder.feed(first_byte) == ""
    assert decoder.flush() == "\ufffd"
    assert decoder.feed(tokenizer.encode("a")[0]) == "a"


def test_unsupported_tokenizer_model_is_named_with_the_supported_ones(metadata):
    with pytest.raises(ModelFileError, match="'bert' is not supported; supported: 'gpt2'.*'llama'"):
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "bert"})


def test_unknown_pre_tokenizer_is_named_with_the_supported_ones(metadata):
    with pytest.raises(ModelFileError, match="'no-such-pre'.*smollm") as error:
        Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": "no-such-pre"})
    assert "qwen2" in str(error.value) and "llama-bpe" in str(error.value)


@pytest.mark.parametrize("pre", ["gpt2", "default"])
def test_gpt2_pre_tokenizers_match_transformers(metadata, reference, pre):
    tokenizer = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": pre})
    for text in TEXTS:
        assert tokenizer.encode(text) == reference.encode(text)


@pytest.mark.parametrize("pre", ["llama-bpe", "llama3", "qwen2", "qwen35", "gpt-4o"])
def test_split_pre_tokenizers_match_transformers(metadata, reference, pre):
    """Later models' regexes, run over SmolLM's vocabulary: what matters is where the text is cut.

    SmolLM's vocabulary has no multi-digit tokens, so the pieces are compared as well as the ids.
    """
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    split = {"type": "Split", "pattern": {"Regex": mapping.GGUF_PRE_TOKENIZER_SPLITS[pre]}, "behavior": "Isolated"}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    pre_tokenizer = {"type": "Sequence", "pretokenizers": [{**split, "invert": False}, byte_level]}
    expected = _with_pre_tokenizer(reference, pre_tokenizer)
    tokenizer = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": pre})
    # combining marks (e\u0301, n\u0303, Devanagari's vowel signs) are where qwen35 cuts otherwise than qwen2
    for text in [*TEXTS, "12345 1234567", "HTTPServer's CamelCase WORDs don'T\r\n/path\n\n  x",
                 "cafe\u0301 n\u0303o \u0928\u092e\u0938\u094d\u0924\u0947 x\u0301!"]:
        assert tokenizer.encode(text) == expected.encode(text).ids
        pieces = tokenizer._backend.pre_tokenizer.pre_tokenize_str(text)
        assert pieces == expected.pre_tokenizer.pre_tokenize_str(text)


@pytest.fixture(scope="module")
def hf_folder(reference, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf")
    reference.save_pretrained(folder)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    return folder


def test_hf_folder_matches_transformers(hf_folder, reference):
    tokenizer = Tokenizer.from_hf_folder(hf_folder)
    for text in TEXTS:
        assert tokenizer.encode(text) == reference.encode(text)
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.apply_chat_template(messages) == expected
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.stop_ids) == (1, 2, frozenset({2}))


def test_hf_folder_bos_comes_from_tokenizer_json(hf_folder, tmp_path):
    spec = json.loads((hf_folder / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    # transformers 5 ignores this flag when there is a tokenizer.json, so must we.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.encode("hello") == expected.encode("hello") == [1, *tokenizer.encode("hello", False)]
    assert tokenizer.stop_ids == frozenset({0, 2})
    assert tokenizer.chat_template is None


def test_hf_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


@pytest.mark.parametrize("text", ["plain words", "😀 héllo", "<|im_start|>user\nhi<|im_end|>", "日本語のテキスト"])
def test_token_bytes_put_back_together_give_the_text(smollm2, text):
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8")
    emoji = tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1 and all(tokenizer.token_bytes(i) != "\N{REPLACEMENT CHARACTER}".encode() for i in emoji)

