"""SentencePiece vocabularies, llama.cpp's tokenizer.ggml.model "llama", as a `tokenizers` BPE; and Gemma 4's
"gemma4", spelled as SentencePiece spells pieces but with merges of its own.

llama.cpp encodes such a vocabulary by joining, again and again, the adjacent pair of pieces that makes the
best-scored piece (the leftmost on a tie), and spells any character the vocabulary lacks in <0xNN> byte pieces
(llm_tokenizer_spm_session in src/llama-vocab.cpp). A BPE whose merges are every split of every piece, best piece
first, with byte fallback, does the same, but for ties between different pieces of one score, which it breaks by
their order in the merges; transformers builds its GGUF SentencePiece tokenizers that way too.
"""
from __future__ import annotations

import re

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers

_SPACE = "\N{LOWER ONE EIGHTH BLOCK}"  # SentencePiece's visible space, "▁"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def sentencepiece_bpe(
    tokens: list[str], ranks: list[float], *, unk_token: str | None, add_space_prefix: bool
) -> Backend:
    """The tokenizer of a SentencePiece vocabulary whose piece `i` joins before any piece ranked below `ranks[i]`.

    With `add_space_prefix`, llama.cpp puts a space before the text and after every special token in it, as
    the prepending normalizer of Llama 2's own tokenizer.json does; decoding takes the first one off again.
    """
    vocab = {piece: index for index, piece in enumerate(_pieces(tokens))}
    return _spelled_bpe(vocab, _merges(vocab, ranks), unk_token, add_space_prefix)


def merged_bpe(tokens: list[str], merges: list[str], *, unk_token: str | None) -> Backend:
    """A BPE spelled as SentencePiece spells pieces (spaces as "▁", raw UTF-8, <0xNN> byte pieces) with merges of
    its own, in rank order (llama.cpp's "gemma4" vocabulary; transformers' GemmaTokenizer builds the same BPE)."""
    vocab = {piece: index for index, piece in enumerate(tokens)}
    return _spelled_bpe(vocab, [tuple(merge.split(" ", 1)) for merge in merges], unk_token, add_space_prefix=False)


def _spelled_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], unk_token: str | None,
                 add_space_prefix: bool) -> Backend:
    backend = Backend(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    spaces = normalizers.Replace(" ", _SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), spaces]) if add_space_prefix else spaces
    strip_prefix = [decoders.Strip(content=" ", left=1, right=0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip_prefix]
    )
    return backend


def piece_bytes(piece: str) -> bytes:
    """The bytes a piece stands for: one byte for a <0xNN> piece, the UTF-8 of its text for the others."""
    byte = _BYTE_PIECE.fullmatch(piece)
    return bytes([int(byte[1], 16)]) if byte else piece.replace(_SPACE, " ").encode("utf-8")


def _pieces(tokens: list[str]) -> list[str]:
    """The pieces as SentencePiece spells them.

    llama.cpp's converter writes user-defined pieces with real spaces, so Gemma's runs of spaces come as "  ";
    spelled back as "▁▁" they join from single spaces like any piece, as in transformers. (llama.cpp matches them
    whole before joining anything, which cuts a run longer than the longest one differently.)
    """
    return [_SPACE * len(token) if token and not token.strip(" ") else token for token in tokens]


def _merges(vocab: dict[str, int], ranks: list[float]) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces, the best-ranked piece's first.

    Among one piece's splits the longer left part comes first, and among equally ranked pieces the earlier one,
    as in transformers' generate_merges, so that both build the same BPE.
    """
    splits = [
        (piece[:cut], piece[cut:], index)
        for piece, index in vocab.items()
        for cut in range(1, len(piece))
        if piece[:cut] in vocab and piece[cut:] in vocab
    ]
    splits.sort(key=lambda split: (-ranks[split[2]], -len(split[0]), -len(split[1]), split[2]))
    return [(left, right) for left, right, _ in splits]
