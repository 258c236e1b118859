"""A multi-turn conversation that keeps its tokens, so each turn only prefills what is new.

The engine's prefix cache keeps the cells of everything the last turn computed; sending the same token
ids again plus the new message hits them. Re-tokenizing the rendered conversation instead could split
the previous answer differently and miss the cache, so the new part is found as text and appended.
"""
from __future__ import annotations

from collections.abc import Iterator

from kvlm.engine.llm import LLM, StreamChunk
from kvlm.sampling.params import SamplingParams
from kvlm.text.tokenizer import checked_template_kwargs


class ChatSession:
    def __init__(self, llm: LLM, params: SamplingParams, system: str | None = None,
                 chat_template_kwargs: dict | None = None) -> None:
        self.llm = llm
        self.params = params
        self.template_kwargs = checked_template_kwargs(chat_template_kwargs or {}, "chat_template_kwargs")
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.history_ids: list[int] = []   # the tokens the engine last held for this conversation
        self.history_text = ""             # the text those tokens stand for
        self.last_output = None

    def send(self, content: str) -> Iterator[StreamChunk]:
        """Stream the assistant's answer to a new user message, then remember both."""
        tokenizer = self.llm.tokenizer
        self.messages.append({"role": "user", "content": content})
        rendered = tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, **self.template_kwargs)
        if self.history_ids and rendered.startswith(self.history_text):
            prompt_ids = self.history_ids + tokenizer.encode(rendered[len(self.history_text):],
                                                             add_special_tokens=False)
        else:
            prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)  # the template writes any BOS
        final = None
        for chunk in self.llm.stream(prompt_ids, self.params):
            final = chunk.output or final
            yield chunk
        self.messages.append({"role": "assistant", "content": final.text})
        self.history_ids = prompt_ids + final.token_ids
        self.history_text = rendered + tokenizer.decode(final.token_ids)
        self.last_output = final
