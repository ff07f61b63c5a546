"""Chat templates rendered with jinja2 the way Hugging Face ``apply_chat_template`` renders them.

MiniMind formats conversations with the Jinja ``chat_template`` stored in its tokenizer
directory (``tokenizer_config.json``). :func:`render_chat` renders such a template without
``transformers``: the same sandboxed environment (``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``), the same ``tojson`` filter (no HTML escaping, non-ASCII kept) and
``raise_exception`` / ``strftime_now`` globals, and the tokenizer's special tokens as variables.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from lit_minimind.errors import DataError

__all__ = ["MINIMIND_CHAT_TEMPLATE", "load_chat_template", "render_chat"]

# MiniMind's own template (model/tokenizer_config.json at jingyaogong/minimind@d65ef2c), for
# tokenizer directories that carry none, such as the embedded default tokenizer.
MINIMIND_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if true %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if open_thinking is defined and open_thinking is true %}
        {{- '<think>\n' }}
    {%- else %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# special-token variables every HF template can use (MiniMind's values)
SPECIAL_TOKENS = {
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>",
}


def load_chat_template(tokenizer_dir: str | os.PathLike[str]) -> str:
    """The chat template of a tokenizer directory.

    Looks, in order, at ``tokenizer_config.json``'s ``chat_template`` (a string, or HF's list
    of named templates, whose ``"default"`` is taken), then at a ``chat_template.jinja`` file;
    a directory with neither (e.g. the embedded default tokenizer) gets
    :data:`MINIMIND_CHAT_TEMPLATE`.

    Raises:
        DataError: ``tokenizer_config.json`` is unreadable or its ``chat_template`` malformed.
    """
    directory = Path(tokenizer_dir)
    config_file = directory / "tokenizer_config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataError(f"cannot read {config_file}: {exc}") from exc
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, list):  # HF: [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
            if template is None:
                raise DataError(f"{config_file}: chat_template lists no \"default\" template "
                                f"(names: {', '.join(map(str, named)) or 'none'})")
        if template is not None:
            if not isinstance(template, str):
                raise DataError(f"{config_file}: chat_template must be a string, got {type(template).__name__}")
            return template
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return MINIMIND_CHAT_TEMPLATE


def render_chat(
    messages: list[dict[str, Any]],
    template: str | None = None,
    add_generation_prompt: bool = False,
    tools: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` with a chat ``template`` (default: MiniMind's), as HF's
    ``tokenizer.apply_chat_template(messages, tokenize=False, ...)`` does.

    Args:
        messages: ``{"role", "content", ...}`` dicts (``reasoning_content``, ``tool_calls``...
            are passed through to the template).
        template: the Jinja source (see :func:`load_chat_template`).
        add_generation_prompt: end with the opening of an assistant turn.
        tools: tool schemas (the template's ``tools`` variable).
        **kwargs: extra template variables (MiniMind's template reads ``open_thinking``).
    """
    compiled = _compile(template if template is not None else MINIMIND_CHAT_TEMPLATE)
    variables = {**SPECIAL_TOKENS, **kwargs}
    return compiled.render(messages=messages, tools=tools, documents=None,
                           add_generation_prompt=add_generation_prompt, **variables)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # HF replaces jinja's tojson, which escapes HTML characters
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise DataError(f"chat template does not compile: {exc.message} (template line {exc.lineno})") from exc
