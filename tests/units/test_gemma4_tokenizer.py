"""Gemma 4's GGUF vocabulary (tokenizer.ggml.model "gemma4", as llama.cpp's converter writes it from tokenizer.json:
its pieces, spelled with "▁" for spaces and <0xNN> byte pieces, and its merges) against transformers' GemmaTokenizer
built from the same pieces and merges, and against llama.cpp reading the same file where llama-cpp-python is
installed. The vocabulary is made here: a BPE trained by `tokenizers` on a small text with Gemma's normalisation,
Gemma's special tokens and byte pieces first. No hub file is involved."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import Regex, models, normalizers, pre_tokenizers, trainers
from transformers import GemmaTokenizer

from helpers.gguf_factory import gguf_metadata, gguf_tensors, llama_config, random_llama, write_gguf
from kvlm.text.tokenizer import StreamDecoder, Tokenizer

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|tool_response>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
CORPUS = ["The quick brown fox jumps over the lazy dog.", "def main():\n    print('hello world')\n\n\n",
          "  indented  text with   runs of spaces", "café crème brûlée, naïve résumé", "numbers 12345 and 3.14159",
          "user\nHello there!\nmodel\nGeneral Kenobi.\n"] * 20
TEXTS = ["", "Hello world", "The lazy dog jumps over the quick brown fox.", "  two leading, then a   b    c",
         "lines\nand\n\n\nmore lines\n", "tabs\tand\r\nreturns", "café 東京 🫩 naïve", "x" + " " * 20 + "y",
         "<|turn>user\nHello there!<turn|>\n<|turn>model\n", "print('hello world')  # <bos> inside"]
CONTROL, BYTE, NORMAL = 3, 6, 1  # llama.cpp token types


@pytest.fixture(scope="module")
def vocabulary() -> tuple[list[str], list[str]]:
    """(pieces by id, merges as "left right") of a BPE trained with Gemma's normalisation (spaces as "▁"), specials
    and byte pieces first. Its words are the runs of newlines and the runs between them, as in Gemma 4's own
    vocabulary, whose pieces hold no newline beside other characters (llama.cpp splits there before its merges;
    transformers splits nothing, which then comes to the same)."""
    backend = Backend(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIAL + BYTES, show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    model = json.loads(backend.to_str())["model"]
    pieces = [piece for piece, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return pieces, merges


def gemma4_metadata(pieces: list[str], merges: list[str]) -> dict:
    """The tokenizer keys Gemma4Model.set_vocab writes: pieces, scores, types, merges, special ids, add_bos."""
    types = [CONTROL if p in SPECIAL else BYTE if p in BYTES else NORMAL for p in pieces]
    return {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": pieces,
            "tokenizer.ggml.scores": [0.0] * len(pieces), "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False}


@pytest.fixture(scope="module")
def ours(vocabulary) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gemma4_metadata(*vocabulary))


@pytest.fixture(scope="module")
def theirs(vocabulary) -> GemmaTokenizer:
    pieces, merges = vocabulary
    return GemmaTokenizer(vocab={p: i for i, p in enumerate(pieces)}, merges=[tuple(m.split(" ", 1)) for m in merges], add_bos_token=True,
                          extra_special_tokens=["<|turn>", "<turn|>"])


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers_gemma_tokenizer(ours, theirs, text):
    assert ours.encode(text) == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decoding_gives_the_text_back_whole_and_streamed(ours, text):
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text
    stream = StreamDecoder(ours)
    assert "".join(stream.feed(i) for i in ids) + stream.flush() == text


def test_generation_stops_where_llama_cpp_stops_a_gemma4_output(ours, vocabulary):
    """llama.cpp ends generation at <eos>, <turn|> (the turn's end) and <|tool_response> (after a call, where the
    result will follow), whatever the file's eos id says (llama-vocab.cpp's end-of-generation texts)."""
    pieces, _ = vocabulary
    assert {pieces.index(t) for t in ("<eos>", "<turn|>", "<|tool_response>")} <= ours.stop_ids


def test_characters_outside_the_vocabulary_fall_back_to_byte_pieces(ours, vocabulary):
    pieces, _ = vocabulary
    ids = ours.encode("🫩", add_special_tokens=False)
    assert [pieces[i] for i in ids] == [f"<0x{b:02X}>" for b in "🫩".encode()]


def test_llama_cpp_reads_the_file_alike(ours, vocabulary, tmp_path):
    """llama.cpp on a GGUF file carrying this vocabulary (on a tiny random Llama): the same ids, special tokens
    matched whole, BOS added."""
    llama_cpp = pytest.importorskip("llama_cpp")
    pieces, merges = vocabulary
    config = llama_config(vocab_size=len(pieces))
    metadata = {**gguf_metadata(config), **gemma4_metadata(pieces, merges)}
    metadata.pop("tokenizer.ggml.pre", None)
    path = write_gguf(tmp_path / "model.gguf", metadata, gguf_tensors(random_llama(config)))
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == ours.encode(text), text
    assert np.all(np.array([llm.detokenize([i]) for i in range(300, 310)]) ==
                  np.array([ours.decode([i]).encode() for i in range(300, 310)]))
