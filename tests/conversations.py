"""Random agent conversations, for checking a prompt count against the engine's.

Each is a chat request's ``messages`` and ``tools`` as agents send them: system prompts,
tool calls with good, empty, malformed and non-object arguments, tool results as strings or
text parts (empty ones included), special tokens and template markers inside text, odd
whitespace and Unicode.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = ["weather", "Paris", "  ", "\n", "<tool_call>", "</s>", "<s>", "é", "漢字", "{", "}", '"q"', "tool", "42",
         " ", "\t", "😀", "<|user|>", "a" * 30]  # fmt: skip
ARGUMENTS = ['{"city": "Paris"}', "", "not json", "[1]", '{"a": {"b": [1, "é"]}}']
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search",
                                      "parameters": {"type": "object", "properties": {"q": {"type": "string",
                                                                                            "description": "é漢"}}}}},
]  # fmt: skip

# A template that reads ``content`` as a string (vLLM's "string" content format) and ends
# every message with a special token, as Llama 3's and Qwen's do.
STRING_TEMPLATE = """
{%- if tools %}<s>system
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}</s>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'assistant' and message.tool_calls is defined %}<|assistant|> {{ message['content'] or '' }}
{%- for call in message.tool_calls %}<tool_call>{"name": "{{ call.function.name }}", "arguments": \
{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}</s>
{% else %}<|{{ message['role'] }}|> {{ message['content'] }}</s>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|> {% endif %}
"""

# One more in the shape of today's agent models' templates: the system message taken out
# of the loop (a namespace, a slice of ``messages``), the date from ``strftime_now``, tools
# written with ``tojson(indent=2)``, tool calls as a dict literal, ``trim`` and ``loop.last``.
AGENT_TEMPLATE = """
{%- set ns = namespace(system='') %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set rest = messages %}
{%- endif %}
{{- bos_token }}<|system|> {{ strftime_now('%Y') | length }} {{ ns.system }}
{%- if tools %} Tools: {% for t in tools %}{{ t.function.name }}={{ t.function | tojson(indent=2) }}\
{% if not loop.last %}, {% endif %}{% endfor %}{% endif %}</s>
{%- for m in rest %}
    {%- if m.role == 'tool' %}<|tool|> {{ m.tool_call_id }}: {{ m.content }}</s>
    {%- elif m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}<tool_call>\
{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}</s>
    {%- else %}<|{{ m.role }}|> {{ m.content | trim }}</s>
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}
"""


def text(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(0, 25)))


def content(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.6:
        return text(rng)
    if r < 0.8:
        return [{"type": "text", "text": text(rng)} for _ in range(rng.randint(1, 3))]
    return None if r < 0.9 else ""


def conversation(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": text(rng)})
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": content(rng) or "hi"})
        if rng.random() < 0.6:
            calls = [{"id": f"call_{i}", "type": "function",
                      "function": {"name": "get_weather", "arguments": rng.choice(ARGUMENTS)}}
                     for i in range(rng.randint(1, 2))]  # fmt: skip
            messages.append({"role": "assistant", "content": rng.choice([None, "", text(rng)]), "tool_calls": calls})
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": content(rng) or "ok"} for c in calls]
        else:
            messages.append({"role": "assistant", "content": text(rng) or "ok"})
    messages.append({"role": "user", "content": text(rng) or "next"})
    return messages, TOOLS[: rng.randint(0, 2)] or None
