"""The tool-call formats by name, and the one a chat template writes calls in.

The chat template is what shows a model how to call tools (it renders past calls in the model's format), so
it names the format as llama.cpp reads it: by the markers it contains. A template with none of them gets no
format; such a model can still be made to call a tool with the JSON fallback, under a grammar.
"""
from __future__ import annotations

from kvlm.tool_calls import gemma4, harmony, hermes, json_fallback, llama3_json, pythonic, qwen3_xml
from kvlm.tool_calls.format import ToolCallFormat

HERMES = hermes.FORMAT
QWEN3_XML = qwen3_xml.FORMAT
LLAMA3_JSON = llama3_json.FORMAT
PYTHONIC = pythonic.PYTHONIC
LFM2 = pythonic.LFM2
JSON_FALLBACK = json_fallback.FORMAT
HARMONY = harmony.FORMAT
GEMMA4 = gemma4.FORMAT
FORMATS: dict[str, ToolCallFormat] = {
    fmt.name: fmt for fmt in (HERMES, QWEN3_XML, LLAMA3_JSON, PYTHONIC, LFM2, JSON_FALLBACK, HARMONY, GEMMA4)
}
# The instruction Meta's pythonic tool prompt (Llama 3.2 small models, and templates modelled on it) gives.
_PYTHONIC_PROMPT = "[func_name1("


def format_for_template(chat_template: str | None) -> ToolCallFormat | None:
    """The format the template writes tool calls in; None when it shows none."""
    template = chat_template or ""
    if harmony.is_harmony_template(template):
        return HARMONY
    if gemma4.START in template:
        return GEMMA4
    if "<tool_call>" in template:
        return QWEN3_XML if "<function=" in template else HERMES
    if "<|tool_call_start|>" in template or "<|tool_list_start|>" in template:
        return LFM2
    if _PYTHONIC_PROMPT in template:
        return PYTHONIC
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return LLAMA3_JSON
    return None
