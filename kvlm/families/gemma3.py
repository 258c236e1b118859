"""Gemma 3 (text): QK-norm, norms before and after attention and MLP, GeGLU, scaled embeddings, and five
sliding-window layers for every full one, whose RoPE has its own base."""
from kvlm.core.family import Family

# Google's chat template for Gemma 3, byte for byte as google/gemma-3-270m-it ships it in tokenizer_config.json and
# chat_template.jinja (older copies of the larger models' take a system message only as a list of parts; this one
# also takes a string). Copied from that model's GGUF tokenizer.chat_template as recorded in
# huggingface/huggingface.js, packages/ollama-utils/src/chat-template-automap.ts, entry "library/gemma3:270m"
# (commit 007948d5aac310316dd57b5d8e5c091e864418dc). A BOS, then turns <start_of_turn>{user|model}\n...<end_of_turn>\n
# ("assistant" is written "model", contents trimmed); a system message opens the first user turn, then a blank line.
# Base files such as gemma-3-270m's GGUF carry no template: they get this one (see Family.default_chat_template).
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def gguf_query_scale(n_layer: int, n_embd: int, n_head: int, head_dim: int) -> float:
    """llama.cpp (LLM_ARCH_GEMMA3) scales scores by 1/sqrt(head_dim), except for the 27B (62 layers), whose
    query_pre_attn_scalar is n_embd / n_head: Q times sqrt(head_dim / that)."""
    return (head_dim / (n_embd // n_head)) ** 0.5 if n_layer == 62 else 1.0


FAMILY = Family(
    name="gemma3", hf_architectures=("Gemma3ForCausalLM",), hf_model_type="gemma3_text", qk_norm=True,
    default_head_dim=256, sandwich_norms=True, activation="gelu_tanh", scaled_embedding=True, hf_norm_offset=1.0,
    sliding_period=6,
    hf_layer_names=(("post_attention_layernorm", "post_attention_norm"), ("pre_feedforward_layernorm", "ffn_norm"),
                    ("post_feedforward_layernorm", "post_ffw_norm")),
    gguf_query_scale=gguf_query_scale, default_chat_template=CHAT_TEMPLATE,
)

FAMILIES = (FAMILY,)
