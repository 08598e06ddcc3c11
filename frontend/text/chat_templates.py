"""Where a model's chat template comes from when its files carry none: a file the user names (`--chat-template`), or
a template RingServe ships for the model's architecture, as llama.cpp falls back to a built-in one.

The built-in templates are RingServe's own, written from each family's documented turn format; they are not copied
from a checkpoint. A model with neither gets its `messages` requests refused, naming the field and what to send.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.ext


@dataclass(frozen=True)
class BuiltinChatTemplate:
    name: str
    source: str
    # The token the template closes each turn with: generation stops on it, as the family's checkpoints configure.
    end_of_turn: str


# Gemma 2 and 3: `<start_of_turn>{user|model}\n{text}<end_of_turn>\n`, a system message prepended to the first user
# turn (the family has no system role), user and model turns alternating from the user's.
_GEMMA = BuiltinChatTemplate("gemma", """\
{%- set ns = namespace(system='', turns=messages) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set ns.system = (messages[0]['content'] | trim) ~ '\\n\\n' -%}
  {%- set ns.turns = messages[1:] -%}
{%- endif -%}
{%- if not ns.turns -%}
  {{- raise_exception('Gemma needs a user message') -}}
{%- endif -%}
{{- bos_token -}}
{%- for message in ns.turns -%}
  {%- set role = 'user' if loop.index0 % 2 == 0 else 'assistant' -%}
  {%- if message['role'] != role -%}
    {{- raise_exception('Gemma takes user and assistant messages in turn, starting with user (after an optional '
                        ~ 'first system message); message ' ~ (loop.index0 + messages | length - ns.turns | length)
                        ~ ' is ' ~ message['role'] ~ ', expected ' ~ role) -}}
  {%- endif -%}
  {{- '<start_of_turn>' ~ ('model' if role == 'assistant' else 'user') ~ '\\n' -}}
  {{- (ns.system if loop.first else '') ~ (message['content'] | trim) ~ '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
""", end_of_turn="<end_of_turn>")

# GGUF `general.architecture` -> the template used when the file has no `tokenizer.chat_template`.
BUILTIN_CHAT_TEMPLATES: dict[str, BuiltinChatTemplate] = {"gemma2": _GEMMA, "gemma3": _GEMMA}


def builtin_chat_template(architecture: str | None) -> BuiltinChatTemplate | None:
    return BUILTIN_CHAT_TEMPLATES.get(architecture or "")


def read_chat_template(path: str | os.PathLike[str], setting: str = "--chat-template") -> str:
    """A Jinja chat template file's text, checked to compile; errors name `setting` and the file."""
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"{setting} {path}: cannot read the chat template: {reason}") from None
    if not source.strip():
        raise ValueError(f"{setting} {path}: the chat template file is empty")
    try:
        jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(source)  # the extensions we render with
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{setting} {path}: not a valid Jinja template (line {exc.lineno}: {exc.message})") from None
    return source
