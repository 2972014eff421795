"""Chat templates: a conversation -> the prompt text the model was trained on.

Templates are Jinja programs shipped with the model (tokenizer_config.json,
chat_template.jinja or the GGUF metadata), so they are untrusted code: they run
in Jinja's immutable sandbox. The environment is the one transformers gives
templates, because that is what template authors test against:

- `trim_blocks` and `lstrip_blocks` on, the `loopcontrols` extension
  ({% break %} / {% continue %});
- globals `raise_exception(msg)` (raises `ChatTemplateError`) and
  `strftime_now(fmt)`;
- a `tojson` filter that keeps non-ASCII text as is and accepts `indent`,
  `separators` and `sort_keys` (Jinja's own escapes HTML characters);
- variables `messages`, `add_generation_prompt`, `tools`, `documents`, the
  named special tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`)
  and any extra keyword arguments, which override the special tokens.

Messages are normalised first, as vLLM does before rendering: keys whose value
is None are dropped (templates test `message.content is defined`), content
given as OpenAI parts is flattened to one string with the text parts joined
by "\n", and tool-call arguments sent as a JSON string become a dict (templates
write them back with `| tojson`).
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

# Appended to the final message for `continue_final_message`; the rendered text
# is cut where it reappears. The trailing space tells whether the template
# trimmed the message: if it survived, the content was rendered verbatim.
_CONTINUE_MARK = "<<folio:continue-final-message>> "


class ChatTemplateError(ValueError):
    """A chat template refused the conversation (its `raise_exception(...)`)."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template rejected the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[tuple[str, str]] = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# What one render may build: Jinja's sandbox stops unsafe attribute access and
# caps range() at 100,000 items, but not the size of what `*`, `**` or a
# padding method makes ('x' * 10**9 is a gigabyte, 10 ** 10 ** 10 never ends).
MAX_ITEMS = 1_000_000           # characters or items of one value, one padding width
MAX_INT_BITS = 4096             # of an integer computed by **
MAX_RENDER_CHARS = 8_000_000    # of the rendered prompt: far beyond any context


def _size(value: Any) -> Optional[int]:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


def _check_int_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_ITEMS:
            raise SecurityError(f"an argument of {value} is larger than a chat template may use")


def _check_growth(name: str, target: Any, args: Sequence[Any]) -> None:
    """replace and join, as filters or methods: refuse what would build more than
    the rendered prompt may hold, before it is built."""
    if name == "replace" and isinstance(target, str) and len(args) >= 2 and \
            isinstance(args[0], str) and isinstance(args[1], str):
        count = target.count(args[0]) if args[0] else len(target) + 1
        if count * len(args[1]) > MAX_RENDER_CHARS:
            raise SecurityError("a replace() larger than a chat template may build")
    elif name == "join" and isinstance(target, (list, tuple)):
        if sum(len(x) for x in target if isinstance(x, str)) > MAX_RENDER_CHARS:
            raise SecurityError("a join() larger than a chat template may build")


def _check_format(fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """A width or precision written in the format (7 digits or more), or passed in."""
    if re.search(r"\d{7,}", fmt):
        raise SecurityError("a format width larger than a chat template may use")
    if re.search(r"\{[^{}]*:[^{}]*\{", fmt):      # '{:>{}}': the width is an argument
        raise SecurityError("a nested format width is more than a chat template may use")
    _check_int_args(args, kwargs)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with the size of `*` and `**` results and of
    integer arguments to methods and filters bounded before they run."""

    intercepted_binops = frozenset(["*", "**", "%", "+"])

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":
            if _size(left) is not None and _size(right) is not None and \
                    _size(left) + _size(right) > MAX_RENDER_CHARS:
                raise SecurityError("a concatenation larger than a chat template may build")
        elif operator == "%":
            if isinstance(left, str):       # printf-style: '%1000000000d' % 1
                _check_format(left, right if isinstance(right, tuple) else (right,), {})
        elif operator == "*":
            for seq, times in ((left, right), (right, left)):
                if _size(seq) is not None and isinstance(times, int) and \
                        _size(seq) * times > MAX_ITEMS:
                    raise SecurityError("a repetition larger than a chat template may build")
        elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                right * abs(left).bit_length() > MAX_INT_BITS:
            raise SecurityError("a power larger than a chat template may compute")
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any):
        wrapped = super().wrap_str_format(value)    # '{:>1000000000}'.format(1)
        if wrapped is None:
            return None

        def checked(*args, **kwargs):
            _check_format(value.__self__, args, kwargs)
            return wrapped(*args, **kwargs)
        return checked

    def call(__self, __context, __obj, *args, **kwargs):   # noqa: N805 - Jinja's signature
        _check_int_args(args, kwargs)
        name = getattr(__obj, "__name__", "")
        if name == "replace":
            _check_growth(name, getattr(__obj, "__self__", None), args)
        elif name == "join" and args:       # sep.join(items)
            _check_growth(name, list(args[0]) if isinstance(args[0], (list, tuple)) else (),
                          ())
        return super().call(__context, __obj, *args, **kwargs)


def _bounded_filter(fn):
    @functools.wraps(fn)        # keeps Jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        _check_int_args(args[1:], kwargs)
        values = [a for a in args if not isinstance(a, (jinja2.Environment, jinja2.runtime.Context,
                                                        jinja2.nodes.EvalContext))]
        if values and fn.__name__ in ("do_replace", "do_join"):
            _check_growth(fn.__name__.rsplit("_", 1)[-1], values[0], values[1:])
        return fn(*args, **kwargs)
    return bounded


def _render_bounded(template: jinja2.Template, variables: dict) -> str:
    parts, size = [], 0
    for chunk in template.generate(**variables):
        size += len(chunk)
        if size > MAX_RENDER_CHARS:
            raise SecurityError(f"the rendered prompt is longer than {MAX_RENDER_CHARS} "
                                "characters")
        parts.append(chunk)
    return "".join(parts)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per distinct template text (rendering is the hot path)."""
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters = {name: _bounded_filter(fn) for name, fn in env.filters.items()}
    del env.globals["lipsum"]       # lorem ipsum generator: no template needs it
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja (line {e.lineno}): {e.message}") from e


def _flatten_content(content: Any) -> Any:
    """OpenAI content parts -> one string (text parts joined by "\n", as vLLM does)."""
    if not isinstance(content, (list, tuple)):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text":
            texts.append(part.get("text") or "")
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"unsupported message content part {kind!r}: only text parts are accepted")
    return "\n".join(texts)


def _parse_tool_arguments(tool_calls: Any) -> Any:
    """Tool-call `arguments` arrive as a JSON string (OpenAI) but templates expect a dict."""
    if not isinstance(tool_calls, (list, tuple)):
        return tool_calls
    parsed = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        args = fn.get("arguments") if isinstance(fn, Mapping) else None
        if isinstance(args, str):
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(args)}}
            except json.JSONDecodeError:
                pass    # leave it as the caller wrote it; the template may cope
        parsed.append(call)
    return parsed


def normalize_messages(messages: Sequence[Any]) -> list[dict]:
    """Plain dict copies of the messages, ready for a template (the caller's are untouched)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    out = []
    for message in messages:
        if hasattr(message, "model_dump"):     # pydantic request models
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise ValueError(f"each message must be a dict, got {type(message).__name__}")
        msg = {k: v for k, v in message.items() if v is not None}
        if "content" in msg:
            msg["content"] = _flatten_content(msg["content"])
        if "tool_calls" in msg:
            msg["tool_calls"] = _parse_tool_arguments(msg["tool_calls"])
        out.append(msg)
    return out


def render_chat(template: str, messages: Sequence[Any], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: Optional[list] = None,
                documents: Optional[list] = None,
                special_tokens: Optional[Mapping[str, Optional[str]]] = None,
                **kwargs: Any) -> str:
    """Render `messages` with `template`.

    `continue_final_message=True` renders the last message open-ended: the text
    stops right after its content, before any end-of-turn the template writes,
    so the model continues that message. It takes precedence over
    `add_generation_prompt` (a new assistant header would make no sense there).
    """
    chat = normalize_messages(messages)
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str):
            raise ValueError("continue_final_message needs a final message with text content")
        chat[-1]["content"] = final + _CONTINUE_MARK
        add_generation_prompt = False
    variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    variables.update(kwargs)
    try:
        text = _render_bounded(compile_template(template), dict(
            variables, messages=chat, add_generation_prompt=add_generation_prompt,
            tools=tools, documents=documents))
    except ChatTemplateError:
        raise
    except (Exception, RecursionError) as e:    # noqa: BLE001 - the template is untrusted code
        # e.g. an undefined variable, `'text' + 3` on a message field the
        # template did not expect, 1 / 0, a size past the bounds above: a bad
        # request (or template), not a server fault.
        raise ValueError(f"the chat template failed to render: {e}") from e
    if continue_final_message:
        text = _cut_after_final_message(text, final)
    return text


def _cut_after_final_message(text: str, final: str) -> str:
    mark = _CONTINUE_MARK.rstrip()
    at = text.rfind(mark)
    if at < 0:
        raise ValueError(
            "continue_final_message is set but the chat template dropped or rewrote the final "
            f"message, so there is no place to continue it from (final message: {final[:80]!r})")
    if text.startswith(_CONTINUE_MARK, at):
        return text[:at]            # rendered verbatim: keep the content's own spacing
    return text[:at].rstrip()       # the template trimmed the message; trim the same way
