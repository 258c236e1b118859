"""What a chat request asks of one turn: the prompt, the constraint on the output (a response format, or a
forced tool call in the model's own format), and how the output is read back (reasoning, tool calls).

Checks follow vLLM and llama.cpp: `tool_choice` without `tools`, a named function not among them, a response
constraint together with tools, or tools sent to a model whose template shows no tool-call format (unless
tool_choice forces a call, which then uses a plain JSON form) are 400s.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import jinja2

from kvlm.core.errors import KvlmError
from kvlm.tool_calls.chat_output import ChatOutputSpec
from kvlm.server.protocol import BadRequest, ChatCompletionRequest, CompletionRequest, TokenizeRequest
from kvlm.structured.compiler import GrammarCompiler, GrammarError
from kvlm.structured.params import StructuredOutputsParams
from kvlm.structured.request_grammar import Triggered
from kvlm.text.tokenizer import Tokenizer
from kvlm.tool_calls.reasoning import reasoning_for_template
from kvlm.tool_calls.tool_choice import plan_tools

log = logging.getLogger("kvlm")


@dataclass(frozen=True)
class ChatTurn:
    prompt_token_ids: list[int]
    constraint: StructuredOutputsParams | None
    output: ChatOutputSpec
    # for the engine: where the constraint starts, when it must wait for the reasoning to end or for a call (ToolPlan)
    reasoning_ended: Callable[[str], int | None] | Triggered | None = None


def chat_prompt(tokenizer: Tokenizer, body: ChatCompletionRequest | TokenizeRequest,
                tools: list[dict] | None = None) -> str:
    messages = [m.as_template_message(tokenizer.content_format) for m in body.messages]
    kwargs = body.template_kwargs()
    try:
        return tokenizer.apply_chat_template(messages, body.add_generation_prompt, tools or None, **kwargs)
    # e.g. a template that wants roles to alternate, or a template kwarg of a type it cannot use
    except (jinja2.TemplateError, KvlmError, TypeError, ValueError) as exc:
        raise BadRequest(f"the chat template refused the messages: {exc}", "messages") from None


async def chat_turn(tokenizer: Tokenizer, grammars: GrammarCompiler, body: ChatCompletionRequest) -> ChatTurn:
    tool_choice, tools = body.effective_tool_choice(), body.tool_dicts()
    constraint = body.constraint()
    calling = tools and tool_choice != "none"
    if calling and constraint is not None:
        raise BadRequest("a response constraint (response_format, structured_outputs, guided_*) cannot be combined "
                         "with tools; send tool_choice \"none\" or drop one of them", "tools")
    try:
        plan = await asyncio.to_thread(plan_tools, tokenizer.chat_template, tools, tool_choice,
                                       body.parallel_tool_calls, grammars.special_tokens)
    except ValueError as exc:
        raise BadRequest(str(exc), "tools") from None
    if plan.forcing_grammar is not None:
        constraint = StructuredOutputsParams(grammar=plan.forcing_grammar)
    await compiled(grammars, constraint, "tools" if calling else constraint_field(body))
    if plan.lazy_grammar is not None:  # calls kept right once the model opens one (tool_choice auto)
        constraint = await lazy_constraint(grammars, plan.lazy_grammar)
    prompt = chat_prompt(tokenizer, body, tools)
    output = ChatOutputSpec(reasoning_for_template(tokenizer.chat_template, prompt), plan.format, tuple(tools),
                            named_tool=plan.named, include_reasoning=body.include_reasoning,
                            parallel=body.parallel_tool_calls)
    return ChatTurn(tokenizer.encode(prompt, add_special_tokens=False), constraint, output,
                    plan.constraint_start(output.reasoning) if constraint is not None else None)


async def lazy_constraint(grammars: GrammarCompiler, grammar: str) -> StructuredOutputsParams | None:
    """The lazy grammar of tool_choice auto, compiled; None (calls read as written, as before such grammars) where the
    tools' schemas use what the grammar engine cannot follow: a request the model may answer without a call is not
    refused for it."""
    constraint = StructuredOutputsParams(grammar=grammar)
    try:
        await asyncio.to_thread(grammars.compile, constraint)
    except GrammarError as exc:
        log.warning("tool calls under tool_choice auto run unconstrained: the tools' grammar cannot compile (%s)", exc)
        return None
    return constraint


async def compiled(grammars: GrammarCompiler, constraint: StructuredOutputsParams | None, field: str) -> None:
    """Compile the constraint off the event loop (cached for the engine); one that cannot compile is a 400 on
    `field`."""
    if constraint is None:
        return
    try:
        await asyncio.to_thread(grammars.compile, constraint)
    except GrammarError as exc:
        raise BadRequest(str(exc), field) from None


def constraint_field(body: ChatCompletionRequest | CompletionRequest) -> str:
    """The request field its constraint came from, for an error's `param`."""
    return next(iter(body.constraints()), "response_format")
