"""Tool calls and reasoning in a model's output, as OpenAI's Chat Completions API returns them.

A model writes tool calls in its own format (hermes `<tool_call>` JSON, Qwen3-Coder XML, Llama 3 JSON,
pythonic lists); `formats.format_for_template` picks the format from the chat template, a format parses
finished text (`parse`), partial text while streaming (`parse_partial`), and writes the Lark grammar that
forces calls in that format (`forcing_grammar`). `streaming.ToolCallStream` turns successive partial parses
into OpenAI deltas; `reasoning` splits `<think>...</think>` off first, since calls are parsed from content only.
gpt-oss's harmony output (`harmony`) is read by its messages' channels instead: reasoning, answer and calls at once.
"""
