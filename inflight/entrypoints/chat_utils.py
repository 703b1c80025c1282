"""Chat messages -> prompt text and token ids, through a Jinja chat template.

The one renderer behind ``LLM.chat``, ``POST /v1/chat/completions`` and ``POST /tokenize``,
so all three build the same prompt from the same messages. Messages follow OpenAI's
shapes, rendered as vLLM renders them for a text-only model:

- ``content`` is a string, a list of content parts, or ``None`` (assistant messages only,
  rendered as ``""``). Any part type but ``text`` (``image_url``, ``input_audio``, ...) is
  refused by name. What the template sees is vLLM's ``chat_template_content_format``:
  ``"string"`` joins the text parts with ``"\\n"`` (vLLM and llama.cpp); ``"openai"`` gives
  it a list of ``{"type": "text", "text": ...}`` parts, a string content as one part;
  ``"auto"`` (the default) picks ``"openai"`` for a template that loops over a message's
  ``content`` (as vLLM detects it, from the template's syntax tree), else ``"string"``.
- ``role`` is any string: the template decides what it can render (a template that raises
  on an unknown role becomes a clear error). ``developer``, OpenAI's newer name for
  ``system``, is renamed ``system`` when the template never mentions ``developer``.
- Other message keys (``name``, ``tool_calls``, ...) are passed to the template as given.
- ``continue_final_message`` leaves the final (assistant) message open for the model to
  continue; with ``add_generation_prompt`` too it is an error, as in vLLM.

Every refusal is a :class:`ValueError` (the server turns it into a 400).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.nodes

CONTENT_FORMATS = ("auto", "string", "openai")

# apply_chat_template's own arguments: chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """A rendered conversation: the template's text and its token ids."""

    prompt: str
    prompt_token_ids: list[int]
    conversation: list[dict[str, Any]]  # the messages as the template saw them


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How to render: vLLM's chat request fields, with vLLM's defaults."""

    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: Mapping[str, Any] | None = None
    documents: Sequence[Mapping[str, Any]] | None = None
    tools: Sequence[Mapping[str, Any]] | None = None  # for templates with a tool format
    content_format: str = "auto"  # vLLM's chat_template_content_format (CONTENT_FORMATS)

    def __post_init__(self) -> None:
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise TypeError(
                f"chat_template must be a Jinja template string, got {type(self.chat_template).__name__}"
            )
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, Mapping):
            raise TypeError(
                "chat_template_kwargs must be a dict of template variables, got "
                f"{type(self.chat_template_kwargs).__name__}"
            )
        if self.content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format must be one of {list(CONTENT_FORMATS)}, "
                f"got {self.content_format!r}"
            )
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        reserved = sorted(set(self.chat_template_kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(
                f"chat_template_kwargs may not set {reserved}: pass them as request fields."
            )


def render_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], options: ChatOptions
) -> RenderedChat:
    """Render ``messages`` with the given (or the tokenizer's) template, then encode.

    The text is encoded with ``add_special_tokens=options.add_special_tokens`` (False by
    default: the template writes the special tokens it wants).
    """
    template = options.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "This model has no chat template: pass a chat_template (or start the server "
            "with --chat-template)."
        )
    if not isinstance(template, str):
        raise ValueError("This model has several named chat templates: pass chat_template.")
    content_format = resolve_content_format(template, options.content_format)
    conversation = parse_messages(messages, template, content_format)
    if options.continue_final_message and conversation[-1]["role"] != "assistant":
        raise ValueError(
            "continue_final_message needs the final message to be an assistant message "
            f"(it has role {conversation[-1]['role']!r})."
        )
    try:
        prompt = tokenizer.apply_chat_template(
            conversation,
            chat_template=options.chat_template,
            documents=list(options.documents) if options.documents is not None else None,
            tools=list(options.tools) if options.tools else None,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            tokenize=False,
            **dict(options.chat_template_kwargs or {}),
        )
    except Exception as error:  # jinja's raise_exception, a syntax error, a missing key
        raise ValueError(f"The chat template failed on these messages: {error}") from error
    token_ids = list(tokenizer.encode(prompt, add_special_tokens=options.add_special_tokens))
    return RenderedChat(prompt=prompt, prompt_token_ids=token_ids, conversation=conversation)


def resolve_content_format(template: str, requested: str = "auto") -> str:
    """``"string"`` or ``"openai"``: ``requested`` unless it is ``"auto"``, then
    ``"openai"`` exactly when the template loops over a message's ``content``
    (``{% for part in message['content'] %}``, ``message.content | selectattr(...)``).
    A template Jinja cannot parse counts as ``"string"`` (rendering reports the error)."""
    if requested != "auto":
        return requested
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    loops = tree.find_all(jinja2.nodes.For)
    return "openai" if any(_reads_content(loop.iter) for loop in loops) else "string"


def _reads_content(node: jinja2.nodes.Node) -> bool:
    """Whether the expression ``node`` is, or contains, ``x.content`` / ``x['content']``."""
    for part in [node, *node.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem))]:
        if isinstance(part, jinja2.nodes.Getattr) and part.attr == "content":
            return True
        if isinstance(part, jinja2.nodes.Getitem) and isinstance(part.arg, jinja2.nodes.Const):
            if part.arg.value == "content":
                return True
    return False


def parse_messages(
    messages: Sequence[Mapping[str, Any]], template: str, content_format: str = "string"
) -> list[dict[str, Any]]:
    """OpenAI-shaped messages -> the plain ``{role, content, ...}`` dicts templates read;
    ``content`` a string (``content_format="string"``) or a list of text parts
    (``"openai"``)."""
    if isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects.")
    return [_parse_message(i, m, template, content_format) for i, m in enumerate(messages)]


def _parse_message(
    index: int, message: Mapping[str, Any], template: str, content_format: str
) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object with 'role' and 'content'.")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}: 'role' must be a non-empty string.")
    if role == "developer" and "developer" not in template:
        role = "system"  # what OpenAI means by it, and what the template knows
    parsed = {k: v for k, v in message.items() if v is not None}
    parsed["role"] = role
    texts = _content_texts(where, role, message.get("content"))
    if content_format == "openai":
        parsed["content"] = [{"type": "text", "text": text} for text in texts]
    else:
        parsed["content"] = "\n".join(texts)
    return parsed


def _content_texts(where: str, role: str, content: Any) -> list[str]:
    """The message's text parts: ``[]`` for a null assistant content, one for a string."""
    if content is None:
        if role != "assistant":
            raise ValueError(f"{where}: 'content' may be null only on assistant messages.")
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ValueError(f"{where}: 'content' must be a string or a list of content parts.")
    texts: list[str] = []
    for part in content:
        part_type = part.get("type") if isinstance(part, Mapping) else None
        if part_type != "text":
            named = f"'{part_type}'" if isinstance(part_type, str) else "without a type"
            raise ValueError(
                f"{where}: content parts of type {named} are not supported: this model "
                "reads text only ('text' parts)."
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}: a 'text' content part needs a string 'text'.")
        texts.append(text)
    return texts
