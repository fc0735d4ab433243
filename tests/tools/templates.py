"""A chat template that renders tools, tool results and earlier tool calls, in the
hermes style (`<tool_call>{...}</tool_call>`), for the tiny test tokenizer."""

TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>tools:{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "{{ eos_token }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|tool|>{{ m['tool_call_id'] }}={{ m['content'] }}"
    "{{ eos_token }}"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|assistant|>{{ m['content'] }}"
    "{% for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}"
    "{{ eos_token }}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
