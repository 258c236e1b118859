"""Whether a draft model's guesses mean the same tokens to the target: llama.cpp's compatibility check."""
from __future__ import annotations

from kvlm.core.errors import KvlmError
from kvlm.text.tokenizer import Tokenizer

MAX_VOCAB_SIZE_DIFFERENCE = 128  # llama.cpp's: Qwen2.5-7B pads its vocabulary 128 ids past the 0.5B's


class IncompatibleDraftError(KvlmError):
    """The draft model's vocabulary differs from the target's."""


def check_vocabularies(target: Tokenizer, draft: Tokenizer) -> None:
    """Same kind of vocabulary, same BOS/EOS, sizes within 128, and the same text for every shared token id."""
    if target.model_type != draft.model_type:
        raise IncompatibleDraftError(f"the draft's vocabulary is {draft.model_type}, the target's {target.model_type}")
    for name in ("bos_id", "eos_id"):
        if getattr(target, name) != getattr(draft, name):
            raise IncompatibleDraftError(f"the draft's {name} is {getattr(draft, name)}, the target's "
                                         f"{getattr(target, name)}")
    difference = abs(target.vocab_size - draft.vocab_size)
    if difference > MAX_VOCAB_SIZE_DIFFERENCE:
        raise IncompatibleDraftError(f"the draft's vocabulary has {draft.vocab_size} tokens, the target's "
                                     f"{target.vocab_size}: more than {MAX_VOCAB_SIZE_DIFFERENCE} apart")
    for token_id in range(min(target.vocab_size, draft.vocab_size)):
        theirs, ours = draft.token_text(token_id), target.token_text(token_id)
        if theirs != ours:
            raise IncompatibleDraftError(f"token {token_id} is {theirs!r} in the draft's vocabulary and {ours!r} "
                                         "in the target's")
