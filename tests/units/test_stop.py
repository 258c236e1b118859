"""StopChecker on the real SmolLM2 tokenizer: stop strings across tokens, held-back text, UTF-8, EOS."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlm.sampling.params import SamplingParams
from kvlm.engine.stop import StopChecker, StopResult

TEXT = "The quick brown fox jumps over the lazy dog. Then it sleeps."
# Emoji, CJK and accents whose UTF-8 bytes SmolLM2 splits across tokens.
UNICODE = "Emoji 😀🎉 and CJK 日本語のテキスト, café ñ 🇫🇷 — done"


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def checker_for(tokenizer, **params) -> StopChecker:
    return StopChecker(tokenizer, SamplingParams(**{"max_tokens": 1000, **params}), tokenizer.stop_ids)


def feed(checker: StopChecker, ids: list[int]) -> list[StopResult]:
    """Every result, up to the one that finishes."""
    results = []
    for token_id in ids:
        results.append(checker.add(token_id))
        if results[-1].finished:
            break
    return results


def joined(results: list[StopResult]) -> str:
    return "".join(r.new_text for r in results)


def assert_stops_before(tokenizer, text: str, stop, expected: str) -> list[StopResult]:
    """Feeding `text` token by token never emits past `expected`, and ends right there for 'stop'."""
    checker = checker_for(tokenizer, stop=stop)
    results = feed(checker, encode(tokenizer, text))
    emitted = ""
    for result in results:
        emitted += result.new_text
        assert expected.startswith(emitted), f"{emitted!r} went past {expected!r}"
        assert "\ufffd" not in result.new_text
    assert emitted == expected == checker.text
    assert results[-1].finished and results[-1].finish_reason == "stop"
    assert not any(r.finished for r in results[:-1])
    return results


def test_without_stop_conditions_the_text_streams_whole(tokenizer):
    ids = encode(tokenizer, TEXT)
    checker = checker_for(tokenizer)
    results = feed(checker, ids)
    assert [r.new_text for r in results] == [tokenizer.decode([i]) for i in ids]
    assert joined(results) == TEXT == checker.text and not checker.finished


def test_a_stop_string_spanning_several_tokens_cuts_the_text_before_it(tokenizer):
    stop = "over the lazy"
    ids = encode(tokenizer, TEXT)
    assert not any("over" in tokenizer.decode([i]) and "lazy" in tokenizer.decode([i]) for i in ids)
    results = assert_stops_before(tokenizer, TEXT, [stop], "The quick brown fox jumps ")
    assert tokenizer.decode(ids[: len(results)]).endswith(stop)  # ends at the token that completes it
    assert results[-1].stop_reason == stop


def test_a_stop_string_inside_one_token(tokenizer):
    assert " jumps" in [tokenizer.decode([i]) for i in encode(tokenizer, TEXT)]
    results = assert_stops_before(tokenizer, TEXT, "ump", "The quick brown fox j")
    assert len(results) == 5 and results[-1].new_text == " j"
    assert_stops_before(tokenizer, TEXT, "The", "")


def test_of_several_stop_strings_the_first_in_the_text_wins(tokenizer):
    # Both end inside " jumps"; vLLM would take "ps", the first listed.
    results = assert_stops_before(tokenizer, TEXT, ["ps", "jum"], "The quick brown fox ")
    assert results[-1].stop_reason == "jum"
    assert_stops_before(tokenizer, TEXT, ["dog", "quick brown"], "The ")


def test_possible_starts_of_a_stop_string_are_held_back_then_released(tokenizer):
    checker = checker_for(tokenizer, stop=["over the moon", "zebra"])
    ids = encode(tokenizer, TEXT)  # The quick brown fox jumps| over| the| lazy| ...
    texts = [(r.new_text, checker.text) for r in (checker.add(i) for i in ids[:8])]
    assert texts[4] == (" jumps", "The quick brown fox jumps")
    assert texts[5] == (" ", "The quick brown fox jumps ")  # "over" held back
    assert texts[6] == ("", "The quick brown fox jumps ")  # "over the" held back
    assert texts[7] == ("over the lazy", "The quick brown fox jumps over the lazy")
    feed(checker, ids[8:])
    assert checker.text == TEXT and not checker.finished


def test_text_held_back_at_the_end_comes_out_at_max_tokens_or_from_finish(tokenizer):
    text = TEXT.removesuffix(".")  # ends in "sleeps", the start of the stop string
    ids = encode(tokenizer, text)
    at_length = StopChecker(tokenizer, SamplingParams(max_tokens=len(ids), stop="sleeps soundly"), frozenset())
    results = feed(at_length, ids)
    assert results[-1].new_text.endswith("sleeps") and not results[-1].finished
    assert joined(results) == text == at_length.text

    early = checker_for(tokenizer, stop="sleeps soundly")
    assert joined(feed(early, ids)) == text.removesuffix("sleeps")
    assert early.finish() == "sleeps" and early.text == text
    assert early.finish() == ""
    with pytest.raises(RuntimeError):
        early.add(ids[0])


@pytest.mark.parametrize("text", [UNICODE, "日本語のテキストを読む。🇯🇵🎌 Ελληνικά русский ✓✓"])
def test_pieces_are_whole_characters(tokenizer, text):
    ids = encode(tokenizer, text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the test needs split characters
    checker = checker_for(tokenizer, stop="never there")
    results = feed(checker, ids)
    assert all("\ufffd" not in r.new_text for r in results)
    assert joined(results) + checker.finish() == tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    "stop, expected",
    [
        ("🎉", "Emoji 😀"),
        ("語のテ", "Emoji 😀🎉 and CJK 日本"),
        (["日本人", "ñ 🇫"], "Emoji 😀🎉 and CJK 日本語のテキスト, café "),  # "日本" held, then released
        ("é", "Emoji 😀🎉 and CJK 日本語のテキスト, caf"),
    ],
)
def test_stop_strings_in_multibyte_text(tokenizer, stop, expected):
    assert_stops_before(tokenizer, UNICODE, stop, expected)


def test_bytes_of_an_unfinished_character_are_dropped_at_the_end(tokenizer):
    ids = encode(tokenizer, UNICODE)
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    checker = StopChecker(tokenizer, SamplingParams(max_tokens=cut), frozenset())
    results = feed(checker, ids[:cut])
    assert joined(results) == tokenizer.decode(ids[:cut]).rstrip("\ufffd") == checker.text
    assert "\ufffd" not in checker.text


def test_eos_ends_the_output_without_its_text(tokenizer):
    eos = tokenizer.eos_id
    assert eos in tokenizer.stop_ids
    ids = encode(tokenizer, "Hello there")
    checker = checker_for(tokenizer)
    results = feed(checker, ids + [eos] + ids)
    assert len(results) == len(ids) + 1
    assert results[-1] == StopResult("", True, "stop", None)
    assert checker.text == "Hello there" and checker.finish_reason == "stop"


def test_eos_releases_held_back_text(tokenizer):
    checker = checker_for(tokenizer, stop="there and back")
    results = feed(checker, encode(tokenizer, "Hello there") + [tokenizer.eos_id])
    assert joined(results[:-1]) == "Hello " and results[-1] == StopResult("there", True, "stop", None)
    assert checker.text == "Hello there"


def test_ignore_eos_goes_on_and_special_tokens_show_no_text(tokenizer):
    ids = encode(tokenizer, "Hello there")
    checker = checker_for(tokenizer, ignore_eos=True)
    results = feed(checker, ids + [tokenizer.eos_id] + ids)
    assert len(results) == 2 * len(ids) + 1 and not results[-1].finished
    assert checker.text == "Hello thereHello there"


def test_stop_token_ids_end_the_output_even_with_ignore_eos(tokenizer):
    ids = encode(tokenizer, TEXT)
    lazy = ids[7]
    assert tokenizer.decode([lazy]) == " lazy"
    checker = checker_for(tokenizer, stop_token_ids=[lazy], ignore_eos=True)
    results = feed(checker, ids)
    assert results[-1] == StopResult("", True, "stop", lazy)
    assert checker.text == "The quick brown fox jumps over the"


ALPHABET = st.sampled_from(list("ab cd\n.,é日本😀🎉") + [" the", "ab", "ñ", "語"])
SHORT_TEXT = st.lists(ALPHABET, min_size=1, max_size=24).map("".join)


@settings(max_examples=60, deadline=None)
@given(text=SHORT_TEXT, data=st.data())
def test_streamed_text_is_the_decoded_text_up_to_the_first_stop_string(tokenizer, text, data):
    ids = encode(tokenizer, text)
    full = tokenizer.decode(ids)
    start = data.draw(st.integers(0, len(full) - 1))
    from_text = full[start : data.draw(st.integers(start + 1, min(len(full), start + 6)))]
    stop = data.draw(st.one_of(st.just(from_text), SHORT_TEXT.map(lambda s: s[:5])))
    checker = StopChecker(tokenizer, SamplingParams(max_tokens=len(ids), stop=stop), frozenset())
    results = feed(checker, ids)
    assert all("\ufffd" not in r.new_text for r in results)
    if stop in full:
        assert joined(results) == full[: full.index(stop)] == checker.text
        assert results[-1].finish_reason == "stop"
        assert stop in tokenizer.decode(ids[: len(results)])
    else:
        assert joined(results) == full == checker.text
        assert not any(r.finished for r in results)
