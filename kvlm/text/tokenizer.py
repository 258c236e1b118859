"""Text to token ids and back, built from a GGUF file's metadata or a Hugging Face tokenizer folder.

The heavy lifting is done by the `tokenizers` library; this module only assembles the pipeline a model
file describes, the same way transformers does, and renders the model's chat template.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from kvlm.core.errors import ModelFileError, UnsupportedModelError
from kvlm.core.family import FAMILIES
from kvlm.families import family_for_hf
from kvlm.text.spm_tokenizer import merged_bpe, piece_bytes, sentencepiece_bpe

_CONTROL = 3  # llama.cpp token types
_USER_DEFINED = 4

# The (?i:...) contraction group is the original tokenizer.json spelling, which transformers keeps;
# llama.cpp spells it '[sS]|'[tT]... for its own regex engine, which matches the same ordinary text.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's (its tokenizer.json; llama.cpp's "qwen35"): Qwen2's, with combining marks (\p{M}) kept in their words
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k's (gpt-oss's tokenizer.json; llama.cpp's "gpt-4o"): a word keeps its case run and its contraction together
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    """GPT-2's regex, built into the ByteLevel pre-tokenizer."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    """SmolLM's own tokenizer.json, and llama.cpp's "smollm": every numeral alone, then GPT-2's regex.

    transformers' GGUF loader has no "smollm" entry and uses GPT-2's regex alone. That differs only on
    whitespace right before a numeral ("x  1", "5 ½", CRLF then a digit), where we follow what the model was
    trained on.
    """
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


# Keyed by `tokenizer.ggml.pre`; a file without one is "default", as in llama.cpp. For "default" llama.cpp
# has its own regexes, but transformers uses GPT-2's, and so do we.
_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2,
    "gpt2": _gpt2,
    "smollm": _digits_then_gpt2,
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": _split_then_bytes(_LLAMA3_SPLIT),
    "llama-v3": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
    "qwen35": _split_then_bytes(_QWEN35_SPLIT),
    "gpt-4o": _split_then_bytes(_O200K_SPLIT),
}

_NAMED_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
_END_OF_TURN_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# llama.cpp ends generation at these tokens too, whatever the metadata says (llama-vocab.cpp): a Qwen base
# model, say, finishes with <|endoftext|> while its eos is <|im_end|>. <|fim_pad|>, <|repo_name|> and <|file_sep|>
# end fill-in-the-middle.
_END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<eos>", "<turn|>", "<|tool_response>",  # Gemma 4: its turn's end, and a call's (its result comes next)
})
# OpenAI's harmony vocabulary (gpt-oss): <|end|> closes one message of a turn (the analysis before the answer), the
# turn ends at <|return|> (answered) or <|call|> (a tool call). llama.cpp drops <|end|> from the stop tokens when both
# of those are among them; kvlm does the same.
_HARMONY_TURN_ENDS, _HARMONY_MESSAGE_END = frozenset({"<|return|>", "<|call|>"}), "<|end|>"

# Names a message's reasoning may come under; transformers copies it to the ones templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Template variables set from apply_chat_template's own arguments, which template kwargs cannot replace.
_RENDER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


class Tokenizer:
    """A model's tokenizer: encode, decode, and its chat template."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_id: int | None,
        eos_id: int | None,
        stop_ids: frozenset[int],
        chat_template: str | None,
        named_tokens: dict[str, str],
        spelled_bytes: Callable[[str], bytes | None],
    ) -> None:
        self._backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.stop_ids = stop_ids
        self.chat_template = chat_template
        self._named_tokens = named_tokens  # bos_token, eos_token, ... as chat templates see them
        self._spelled_bytes = spelled_bytes  # a vocabulary token's bytes, None for a token spelled as plain text
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        model_type = metadata.get("tokenizer.ggml.model")
        if model_type not in _GGUF_VOCABULARIES:
            raise ModelFileError(
                f"tokenizer.ggml.model={model_type!r} is not supported; supported: "
                + ", ".join(f"{name!r} ({kind.description})" for name, kind in _GGUF_VOCABULARIES.items())
            )
        kind = _GGUF_VOCABULARIES[model_type]
        tokens: list[str] = _required(metadata, "tokenizer.ggml.tokens")
        ids = _named_token_ids(metadata, len(tokens))
        named_tokens = {name: tokens[i] for name, i in ids.items() if i is not None}
        backend = kind.backend(metadata, tokens, named_tokens)
        _add_gguf_special_tokens(backend, tokens, metadata.get("tokenizer.ggml.token_type", []), named_tokens)
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind.adds_bos)
        backend.post_processor = _boundary_tokens(
            _wanted(add_bos, named_tokens.get("bos_token"), ids["bos_token"]),
            _wanted(metadata.get("tokenizer.ggml.add_eos_token"), named_tokens.get("eos_token"), ids["eos_token"]),
        )
        stop_ids = {metadata.get(key) for key in ("tokenizer.ggml.eos_token_id", *_END_OF_TURN_KEYS)}
        stop_ids |= {i for i, token in enumerate(tokens) if token in _END_OF_GENERATION_TEXTS}
        return cls(
            backend,
            bos_id=ids["bos_token"],
            eos_id=ids["eos_token"],
            stop_ids=_without_harmony_message_end({i for i in stop_ids if i is not None}, tokens),
            chat_template=_gguf_chat_template(metadata),
            named_tokens=named_tokens,
            spelled_bytes=kind.spelled_bytes,
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """tokenizer.json, tokenizer_config.json (special tokens, chat template) and generation_config.json."""
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelFileError(f"{folder}: no tokenizer.json")
        backend = Backend.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")
        named_tokens = {
            name: _token_content(config[name]) for name in _NAMED_TOKEN_KEYS if config.get(name) is not None
        }
        # BOS/EOS come from tokenizer.json's post-processor; like transformers 5, add_bos_token in the
        # config does not override it.
        bos_id = _token_id(backend, named_tokens.get("bos_token"))
        eos_id = _token_id(backend, named_tokens.get("eos_token"))
        # generation_config.json lists every id generation stops at, e.g. Llama 3's <|eot_id|> besides eos.
        generation_eos = _read_json(folder / "generation_config.json").get("eos_token_id", [])
        stop_ids = {eos_id, *(generation_eos if isinstance(generation_eos, list) else [generation_eos])}
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            stop_ids=frozenset(i for i in stop_ids if i is not None),
            chat_template=_hf_chat_template(folder, config),
            named_tokens=named_tokens,
            spelled_bytes=_byte_level_bytes,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it become their single ids."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The whole tokenizer as `tokenizers` serialises it (what llguidance builds its token trie from)."""
        return self._backend.to_str()

    @property
    def model_type(self) -> str:
        """The kind of vocabulary model (`BPE`, `Unigram`, ...), as `tokenizers` names it."""
        return type(self._backend.model).__name__

    def token_text(self, token_id: int) -> str | None:
        """A token's text as the vocabulary writes it (byte-level symbols, SentencePiece's ▁), None outside it."""
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: part of a character, for a byte-level or <0xNN> token that splits one."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        spelled = None if token_id in self._backend.get_added_tokens_decoder() else self._spelled_bytes(token)
        return self.decode([token_id]).encode("utf-8") if spelled is None else spelled

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt the model's own chat template makes of `messages`, rendered as transformers renders it.

        `tools` are OpenAI-style function specs; `template_kwargs` (e.g. enable_thinking=False) become template
        variables, overriding bos_token and the like as in transformers.
        """
        if self.chat_template is None:
            raise ModelFileError("this model has no chat template; give it a plain prompt instead")
        return _compile_template(self.chat_template).render(
            messages=_template_messages(messages),
            tools=_tool_schemas(tools),
            add_generation_prompt=add_generation_prompt,
            **{"documents": None, **self._named_tokens, **template_kwargs},
        )

    @property
    def content_format(self) -> str:
        """How the chat template reads a message's content: "openai" (it loops over a list of parts) or "string";
        see kvlm.server.protocol.ChatMessage.as_template_message, which gives it parts accordingly."""
        return "string" if self.chat_template is None else _content_format(self.chat_template)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """The chat prompt's token ids; the template writes any BOS itself, so none is added (as transformers)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


class StreamDecoder:
    """Turns generated ids into text as they arrive, never emitting part of a character.

    Each step decodes a short window of recent ids twice, with and without the new ones, and emits the
    difference. Decoding the window rather than single ids keeps decoders that look at neighbouring
    tokens (like SentencePiece's leading-space rule) right; a window ending in U+FFFD means the last
    character's bytes are still incomplete, so it is held back until they arrive.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window, already emitted, decoded again only as context
        self._read = 0  # ids before this one have been emitted

    def feed(self, token_id: int) -> str:
        """The text that `token_id` completes, possibly empty."""
        self._ids.append(token_id)
        text = self._pending_text()
        if not text or text.endswith("\N{REPLACEMENT CHARACTER}"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text

    def flush(self) -> str:
        """Whatever is left, even an incomplete character; the decoder starts afresh afterwards."""
        text = self._pending_text()
        self._ids.clear()
        self._prefix = self._read = 0
        return text

    def _pending_text(self) -> str:
        emitted = self._decode(self._ids[self._prefix : self._read])
        return self._decode(self._ids[self._prefix :])[len(emitted) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _required(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        model_type = metadata.get("tokenizer.ggml.model")
        raise ModelFileError(f"the GGUF metadata has no {key}, which its {model_type!r} tokenizer needs")
    return metadata[key]


def _named_token_ids(metadata: dict[str, Any], vocab_size: int) -> dict[str, int | None]:
    ids = {name: metadata.get(key) for name, key in _NAMED_TOKEN_KEYS.items()}
    for name, token_id in ids.items():
        if token_id is not None and not 0 <= token_id < vocab_size:
            raise ModelFileError(f"the GGUF metadata's {name} id {token_id} is outside its {vocab_size} tokens")
    return ids


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    if name not in _PRE_TOKENIZERS:
        raise ModelFileError(
            f"unknown pre-tokenizer tokenizer.ggml.pre={name!r}; supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    return _PRE_TOKENIZERS[name]()


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    unprintable = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(unprintable)}}


@cache
def _byte_alphabet_inverse() -> dict[str, int]:
    return {char: byte for byte, char in _byte_alphabet().items()}


def _byte_level_bytes(token: str) -> bytes | None:
    """The bytes a byte-level token is spelled in; None for one spelled as plain text."""
    byte_of = _byte_alphabet_inverse()
    return bytes(byte_of[char] for char in token) if set(token) <= byte_of.keys() else None


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> models.BPE:
    alphabet = _byte_alphabet()
    unspelled = re.compile("[^" + "".join(re.escape(char) for char in alphabet.values()) + "]").search

    def spell(token: str) -> str:
        # Some converters store a token as raw text instead of in the byte alphabet; transformers respells it.
        return token if unspelled(token) is None else "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab = dict(zip(map(spell, tokens), range(len(tokens))))  # (a 250k vocabulary: 0.05 s; a set per token took 0.17)
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    return models.BPE(
        vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
    )


def _byte_level_backend(metadata: dict[str, Any], tokens: list[str], named_tokens: dict[str, str]) -> Backend:
    backend = Backend(_byte_level_bpe(tokens, _required(metadata, "tokenizer.ggml.merges")))
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    return backend


# transformers joins a Gemma vocabulary's pieces in file order rather than by score. The two agree on ordinary
# pieces, but Gemma's runs of spaces carry llama.cpp's placeholder score for user-defined pieces (-1000) while
# SentencePiece matches them before anything else; in file order they come first.
_POSITION_RANKED_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})


def _sentencepiece_backend(metadata: dict[str, Any], tokens: list[str], named_tokens: dict[str, str]) -> Backend:
    scores: list[float] = _required(metadata, "tokenizer.ggml.scores")
    if len(scores) != len(tokens):
        raise ModelFileError(f"the GGUF metadata has {len(scores)} tokenizer.ggml.scores for {len(tokens)} tokens")
    by_position = metadata.get("general.architecture") in _POSITION_RANKED_ARCHITECTURES
    return sentencepiece_bpe(
        tokens,
        [-index for index in range(len(tokens))] if by_position else scores,
        unk_token=named_tokens.get("unk_token"),
        add_space_prefix=metadata.get("tokenizer.ggml.add_space_prefix", True),
    )


def _gemma4_backend(metadata: dict[str, Any], tokens: list[str], named_tokens: dict[str, str]) -> Backend:
    """Gemma 4's vocabulary: BPE with its file's merges over the text with spaces as "▁" (llama.cpp's "gemma4")."""
    return merged_bpe(tokens, _required(metadata, "tokenizer.ggml.merges"), unk_token=named_tokens.get("unk_token"))


class _GgufVocabulary(NamedTuple):
    description: str
    backend: Callable[[dict[str, Any], list[str], dict[str, str]], Backend]
    spelled_bytes: Callable[[str], bytes | None]
    adds_bos: bool  # when the file has no tokenizer.ggml.add_bos_token, as in llama.cpp


# Keyed by `tokenizer.ggml.model`.
_GGUF_VOCABULARIES = {
    "gpt2": _GgufVocabulary("byte-level BPE", _byte_level_backend, _byte_level_bytes, adds_bos=False),
    "llama": _GgufVocabulary("SentencePiece", _sentencepiece_backend, piece_bytes, adds_bos=True),
    # llama.cpp's converter writes add_bos_token true for Gemma 4 (and llama.cpp adds BOS even where a file says false)
    "gemma4": _GgufVocabulary("Gemma 4's BPE", _gemma4_backend, piece_bytes, adds_bos=True),
}


def _add_gguf_special_tokens(
    backend: Backend, tokens: list[str], token_types: list[int], named_tokens: dict[str, str]
) -> None:
    """Make control and user-defined tokens match whole in text, as transformers' GGUF loader does.

    A token the vocabulary spells otherwise is left alone rather than given a new id past the vocabulary: in a
    byte-level one, a token marked control but spelled outside the byte alphabet is a llama.cpp mislabel.
    """
    def in_vocab(token: str) -> bool:  # (asked of a few hundred tokens: cheaper than the whole vocabulary as a dict)
        return backend.token_to_id(token) is not None

    control = [t for t, kind in zip(tokens, token_types) if kind == _CONTROL and in_vocab(t)]
    user_defined = [t for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and in_vocab(t)]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])
    added = {*control, *user_defined}
    named = [t for t in named_tokens.values() if t not in added and in_vocab(t)]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in named])


def _without_harmony_message_end(stop_ids: set[int], tokens: list[str]) -> frozenset[int]:
    """The stop tokens less <|end|> when <|return|> and <|call|> are among them (see _HARMONY_TURN_ENDS)."""
    stop_texts = {tokens[i] for i in stop_ids if 0 <= i < len(tokens)}
    if _HARMONY_TURN_ENDS <= stop_texts:
        stop_ids = {i for i in stop_ids if not (0 <= i < len(tokens) and tokens[i] == _HARMONY_MESSAGE_END)}
    return frozenset(stop_ids)


def _wanted(flag: bool | None, token: str | None, token_id: int | None) -> tuple[str, int] | None:
    """A boundary token the model asks for and has; transformers drops the flag when the token is missing."""
    return (token, token_id) if flag and token is not None and token_id is not None else None


def _boundary_tokens(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """The post-processor that puts BOS before and EOS after a text, for those the model asks for."""
    single = " ".join([*([f"{bos[0]}:0"] if bos else []), "$A:0", *([f"{eos[0]}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos[0]}:1"] if bos else []), "$B:1", *([f"{eos[0]}:1"] if eos else [])])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=[t for t in (bos, eos) if t])


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path}: unreadable ({exc})") from exc


def _token_content(token: str | dict[str, Any]) -> str:
    """tokenizer_config.json writes a special token as a string or as a serialized AddedToken."""
    return token["content"] if isinstance(token, dict) else token


def _token_id(backend: Backend, token: str | None) -> int | None:
    return None if token is None else backend.token_to_id(token)


def _gguf_chat_template(metadata: dict[str, Any]) -> str | None:
    """The file's own template, else its family's built-in one (Gemma 3's base GGUFs carry none)."""
    template = metadata.get("tokenizer.chat_template")
    if template is not None:
        return template
    architecture = metadata.get("general.architecture")
    family = FAMILIES.get(architecture) if isinstance(architecture, str) else None
    return family.default_chat_template if family else None


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json, as in transformers; of a list, the "default".

    A folder with neither gets its family's built-in template, if the family has one.
    """
    template_file = folder / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        return next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is not None:
        return template
    try:
        family = family_for_hf(_read_json(folder / "config.json"), folder)
    except UnsupportedModelError:  # a tokenizer-only folder, or an architecture kvlm does not run
        return None
    return family.default_chat_template


def checked_template_kwargs(value: Any, source: str) -> dict[str, Any]:
    """Extra chat template variables, refused when not an object or when they would replace the render's own."""
    if not isinstance(value, dict):
        raise ValueError(f"{source} must be a JSON object, got {type(value).__name__}: {value!r}")
    clashes = sorted(_RENDER_VARIABLES & value.keys())
    if clashes:
        raise ValueError(f"{source} cannot set {', '.join(clashes)}; the chat template gets "
                         f"{', '.join(sorted(_RENDER_VARIABLES))} from their own arguments")
    return value


def _tool_schemas(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as JSON schemas; transformers also converts Python functions, which kvlm does not."""
    if tools is None:
        return None
    for tool in tools:
        if not isinstance(tool, dict):
            raise ValueError(f"a tool must be a JSON schema (a dict), got {type(tool).__name__}: {tool!r}")
    return list(tools)


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: no None values, reasoning under every name."""
    prepared = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}` marks assistant text for training masks; rendering keeps the text as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """`dict` for templates, without the class attributes that could reach Python internals."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` for templates, refusing underscore names that could reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no named self, so `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change what the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@cache
def _template_environment() -> ImmutableSandboxedEnvironment:
    """The sandboxed environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@cache
def _compile_template(source: str) -> jinja2.Template:
    return _template_environment().from_string(source)


@cache
def _content_format(source: str) -> str:
    """"openai" if the template loops over a message's content (a list of parts), else "string": vLLM's
    detection (entrypoints/chat_utils.py, _detect_content_format), by the template's syntax tree alone."""
    loops = _template_environment().parse(source).find_all(jinja2.nodes.For)
    return "openai" if any(_reads_content(loop.iter) for loop in loops) else "string"


def _reads_content(node: jinja2.nodes.Node) -> bool:
    """Whether a loop's iterable is x['content'] or x.content (through any filters)."""
    while isinstance(node, jinja2.nodes.Filter):
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return isinstance(node, jinja2.nodes.Getattr) and node.attr == "content"
