"""A draft model: a smaller model of the same vocabulary that guesses greedily, with a memory of its own.

Its sequences use the target's sequence ids. Each holds a prefix of the target's tokens (`held`); to guess, the
draft first takes the tokens it has not seen (the last sampled one, or a whole prompt the first time) and then
its own guesses one step at a time, all requests together. After the target's verification, the cells of its
guesses that the target did not emit are removed (a recurrent draft goes back to its state before guessing),
so its memory again holds only tokens of the target's sequence.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


from kvlm.core.batch import Batch
from kvlm.runtime.context import Context, DecodeStatus
from kvlm.core.errors import KvlmError
from kvlm.loader.load import Model
from kvlm.memory.kv_store import resolve_kv_dtype
from kvlm.speculative.stats import n_matching
from kvlm.speculative.tuning import StepCosts
from kvlm.speculative.vocab import check_vocabularies
from kvlm.text.tokenizer import Tokenizer


class DraftError(KvlmError):
    """The draft model could not run a step."""


@dataclass
class DraftWant:
    """One sequence to guess for: the target's tokens so far (the last one not yet computed) and how many."""

    seq_id: int
    tokens: list[int]
    count: int


class DraftModel:
    def __init__(self, model: Model, target: Tokenizer, target_vocab: int, n_ctx: int, n_seq_max: int,
                 n_batch: int) -> None:
        check_vocabularies(target, model.tokenizer)
        self.model = model
        self.target_vocab = target_vocab
        kv_dtype = resolve_kv_dtype("auto", model.decoder.dtype, model.decoder.quantized)
        self.context = Context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=n_seq_max,
                               kv_dtype=kv_dtype)
        self.held: dict[int, int] = {}  # seq id -> how many of the target's tokens its memory holds
        self._checkpoints: dict[int, tuple[int, object]] = {}
        self.costs = StepCosts()  # seconds of a draft step by its rows

    def forget(self, seq_id: int) -> None:
        """The target released the sequence: so does the draft."""
        self.context.memory.seq_rm(seq_id, -1, -1)
        self.held.pop(seq_id, None)
        self._checkpoints.pop(seq_id, None)

    def propose(self, wants: list[DraftWant]) -> list[list[int]]:
        """Up to `count` greedy guesses for each sequence (fewer where the draft's token is not the target's); none
        if the draft cannot run (its memory full), its sequences then as they were."""
        memory = self.context.memory
        for want in wants:
            held = self.held.get(want.seq_id, 0)
            self._checkpoints[want.seq_id] = (held, memory.checkpoint(want.seq_id))
        try:
            return self._guess(wants)
        except DraftError:
            for want in wants:
                self._take_back(want.seq_id)
            return [[] for _ in wants]

    def _guess(self, wants: list[DraftWant]) -> list[list[int]]:
        # first the tokens each has not seen; the logits of the last give the first guess
        last = self._catch_up(wants)
        guesses = [[token] if token < self.target_vocab else [] for token in last]
        for want in wants:
            self.held[want.seq_id] = len(want.tokens)
        stopped = [not guessed for guessed in guesses]  # a token the target does not have ends the guesses
        while True:
            going = [i for i, want in enumerate(wants) if not stopped[i] and len(guesses[i]) < want.count]
            if not going:
                return guesses
            nexts = self._decode([guesses[i][-1] for i in going],
                                 [len(wants[i].tokens) + len(guesses[i]) - 1 for i in going],
                                 [wants[i].seq_id for i in going], [True] * len(going))
            for i, token in zip(going, nexts):
                if token < self.target_vocab:
                    guesses[i].append(token)
                else:
                    stopped[i] = True

    def settle(self, seq_id: int, n_before: int, guesses: list[int], emitted: list[int]) -> None:
        """After verification: keep the draft's cells of guesses the target emitted, remove the others.

        `n_before`: the target's token count when the guesses were made (the draft then held that many)."""
        keep = n_before + n_matching(guesses[:-1], emitted)  # (the last guess was never fed to the draft)
        memory = self.context.memory
        if memory.seq_pos_max(seq_id) < keep or memory.seq_rm(seq_id, keep, -1):
            self.held[seq_id] = min(keep, memory.seq_pos_max(seq_id) + 1)
            self._checkpoints.pop(seq_id, None)
        else:  # a recurrent draft: back to its state before guessing; its unseen tokens are fed next time
            self._take_back(seq_id)

    def _take_back(self, seq_id: int) -> None:
        """The sequence as it was before the last proposal (its cells after that removed, or its state restored)."""
        held, checkpoint = self._checkpoints.pop(seq_id)
        memory = self.context.memory
        if not memory.seq_rm(seq_id, held, -1):
            memory.restore(checkpoint)
        self.held[seq_id] = held

    def _catch_up(self, wants: list[DraftWant]) -> list[int]:
        """Feed each sequence the target's tokens it does not hold; the draft's next token after each."""
        n_batch = self.context.n_batch
        pending = [want.tokens[self.held.get(want.seq_id, 0):] for want in wants]
        starts = [self.held.get(want.seq_id, 0) for want in wants]
        # long catch-ups (a whole prompt) first, alone, in chunks that leave their last token for the shared batch
        for i, want in enumerate(wants):
            while len(pending[i]) > max(1, n_batch // len(wants)):
                n = min(len(pending[i]) - 1, n_batch)
                self._decode(pending[i][:n], list(range(starts[i], starts[i] + n)), [want.seq_id] * n, [False] * n)
                pending[i], starts[i] = pending[i][n:], starts[i] + n
        tokens, positions, seq_ids, outputs = [], [], [], []
        for want, part, start in zip(wants, pending, starts):
            tokens += part
            positions += range(start, start + len(part))
            seq_ids += [want.seq_id] * len(part)
            outputs += [False] * (len(part) - 1) + [True]
        return self._decode(tokens, positions, seq_ids, outputs)

    def _decode(self, tokens: list[int], positions: list[int], seq_ids: list[int], outputs: list[bool]) -> list[int]:
        started = time.perf_counter()
        status = self.context.decode(Batch(tokens=tokens, pos=positions, seq_ids=seq_ids, logits=outputs))
        if status != DecodeStatus.OK:
            raise DraftError(f"the draft model's decode failed with {status.name}: {self.context.last_error}")
        nexts = self.context.argmax_ids()
        self.costs.observe(len(tokens), time.perf_counter() - started)
        return nexts
