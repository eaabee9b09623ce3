"""Chat templates: Qwen3's format as a built-in Jinja template, rendered like transformers.

Templates run in a sandboxed Jinja environment configured as transformers configures its own
(same options, filters and globals), so a checkpoint's template renders here exactly as
``AutoTokenizer.apply_chat_template(..., tokenize=False)`` renders it. Where a tokenizer
directory has no template, :data:`QWEN3_CHAT_TEMPLATE` is used.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
# Older names transformers accepts for an assistant turn's reasoning (it copies them over).
_REASONING_ALIASES: tuple[str, ...] = ("reasoning_content", "thinking", "reasoning")

# Qwen3's chat format for system/user/assistant/tool turns, written for spade_jax:
#  * a leading system message opens the prompt; later system messages are ordinary turns;
#  * an assistant turn's reasoning (``reasoning_content``, else the text before ``</think>``)
#    is kept, inside ``<think>\n...\n</think>\n\n``, only for turns after the last real user
#    query (a user message that is not a wrapped tool response), and there only for the final
#    message or when the reasoning is non-empty; earlier turns are rendered without it;
#  * consecutive tool messages share one user turn, each wrapped in <tool_response> tags;
#  * the generation prompt is ``<|im_start|>assistant\n``, plus an empty think block when
#    ``enable_thinking`` is false;
#  * tools (``tools=``, JSON schemas in the function format) open the system turn, after
#    the system message if there is one: a "# Tools" section listing one schema per line
#    inside <tools></tools> and saying how to call them (the wording is this project's, the
#    tags and layout Qwen3's); an assistant turn's ``tool_calls`` follow its content, each as
#    <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> (arguments given as a string
#    are written as they are), separated by newlines.
# A checkpoint's own template, when it has one, renders instead of this one.
QWEN3_CHAT_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content + '\n\n' }}
{%- endif %}
{{- '# Tools\n\nYou can call the functions described below. Their signatures are JSON schemas inside <tools></tools> tags:\n<tools>' }}
{%- for tool in tools %}
{{- '\n' + tool | tojson }}
{%- endfor %}
{{- '\n</tools>\n\nTo call a function, write one JSON object with its name and arguments inside <tool_call></tool_call> tags; use one block per call:\n<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set query = namespace(index=messages|length - 1, found=false) %}
{%- for message in messages|reverse %}
{%- if not query.found and message.role == 'user' and message.content is string
      and not (message.content.startswith('<tool_response>')
               and message.content.endswith('</tool_response>')) %}
{%- set query.index = messages|length - 1 - loop.index0 %}
{%- set query.found = true %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = '' %}
{%- if message.reasoning_content is string %}
{%- set reasoning = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > query.index and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
{%- else %}
{{- '<|im_start|>assistant\n' + content }}
{%- endif %}
{%- if message.tool_calls %}
{%- for call in message.tool_calls %}
{%- if not loop.first or content %}
{{- '\n' }}
{%- endif %}
{%- if call.function %}
{%- set call = call.function %}
{%- endif %}
{{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}
{{- call.arguments }}
{%- else %}
{{- call.arguments | tojson }}
{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
{%- endif %}
{%- endif %}
"""

Message = Mapping[str, Any]


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes, as transformers' sandbox does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _GenerationMarks(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marks).

    transformers uses the marks to find assistant tokens; here the body just renders, in the
    same call-block scope transformers gives it.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    # Chat templates shipped with checkpoints are untrusted code: same sandbox and options as
    # transformers (trim_blocks, lstrip_blocks, loop controls), so renderings agree exactly.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationMarks, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["namespace"] = _TemplateNamespace
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def _normalize_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Validate a conversation and copy it the way transformers hands it to the template."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {messages!r:.80}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {message!r:.80}")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise ValueError(f"message {i}: role {role!r} is not one of {CHAT_ROLES}")
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise ValueError(f"message {i} ({role}): only an assistant turn has tool_calls")
            _check_tool_calls(calls, i)
        # An assistant turn made of tool calls alone may have no content (None or absent).
        if not isinstance(content, str) and not (calls and content is None):
            raise ValueError(f"message {i} ({role}): 'content' must be a str, got {content!r:.80}")
        # transformers drops None-valued keys and copies older reasoning names to
        # reasoning_content, the field templates read.
        copied = {key: value for key, value in message.items() if value is not None}
        reasoning = next((copied[k] for k in _REASONING_ALIASES if k in copied), None)
        if reasoning is not None:
            copied = {"thinking": reasoning, **copied, "reasoning_content": reasoning}
        normalized.append(copied)
    return normalized


def _check_tool_calls(calls: Any, index: int) -> None:
    """An assistant turn's ``tool_calls``: a list of {"function": {"name", "arguments"}}
    (the OpenAI / transformers layout) or of {"name", "arguments"}; arguments a dict or a
    JSON string."""
    if isinstance(calls, str | bytes | Mapping) or not isinstance(calls, Sequence):
        raise ValueError(f"message {index}: tool_calls must be a list, got {calls!r:.80}")
    for k, call in enumerate(calls):
        inner = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(inner, Mapping) or not isinstance(inner.get("name"), str):
            raise ValueError(f"message {index}: tool call {k} needs a 'name' (str), alone or "
                             f"under 'function', got {call!r:.80}")
        if not isinstance(inner.get("arguments", {}), Mapping | str):
            raise ValueError(f"message {index}: tool call {k} ({inner['name']}): 'arguments' "
                             f"must be a dict or a JSON string")


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Tool definitions as a template receives them: None, or a list of JSON-schema dicts
    (``{"type": "function", "function": {"name", "description", "parameters"}}``, or the
    inner function dict alone), each with a name."""
    if tools is None:
        return None
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise TypeError(f"tools must be a list of JSON-schema dicts, got {tools!r:.80}")
    checked = []
    for k, tool in enumerate(tools):
        inner = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(inner, Mapping) or not isinstance(inner.get("name"), str):
            raise ValueError(f"tool {k} must be a JSON-schema dict with a 'name' (alone or "
                             f"under 'function'), got {tool!r:.80}")
        try:
            json.dumps(tool)
        except (TypeError, ValueError) as err:
            raise ValueError(f"tool {k} ({inner['name']}) is not JSON: {err}") from err
        checked.append(dict(tool))
    return checked


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template plus the special-token strings transformers passes to it.

    Attributes:
      source: the Jinja template text (compiled on construction, so a broken one fails early).
      special_tokens: names such as ``eos_token`` -> token string, visible to the template.
    """

    source: str = QWEN3_CHAT_TEMPLATE
    special_tokens: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError("chat template source must be a non-empty string")
        try:
            _compile_template(self.source)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"chat template does not parse: {err} (line {err.lineno})") from err

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        enable_thinking: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The conversation as text, as transformers' ``apply_chat_template(messages,
        tools=tools, tokenize=False, ...)`` renders it with this template. ``tools``: JSON
        schemas of the functions the model may call (:func:`check_tools`); assistant turns
        may carry ``tool_calls``."""
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("enable_thinking", enable_thinking)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        return _compile_template(self.source).render(
            messages=_normalize_messages(messages),
            tools=check_tools(tools),
            documents=None,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            **dict(self.special_tokens),
        )


def read_tokenizer_config(directory: pathlib.Path) -> dict[str, Any]:
    config_file = directory / "tokenizer_config.json"
    if not config_file.is_file():
        return {}
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must hold a JSON object")
    return config


def find_chat_template(directory: pathlib.Path, config: Mapping[str, Any]) -> str:
    """chat_template.jinja, else tokenizer_config.json's chat_template, else Qwen3's format."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        return QWEN3_CHAT_TEMPLATE
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template
                 if isinstance(entry, dict)}
        if "default" not in named:
            raise ValueError(f"{directory}: chat_template list has no 'default' entry "
                             f"(names: {sorted(map(str, named))})")
        template = named["default"]
    if not isinstance(template, str):
        raise ValueError(f"{directory}: chat_template must be a string, got {type(template).__name__}")
    return template
