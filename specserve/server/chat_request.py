"""The chat-specific parts of a request and its reply: `chat_template_kwargs` (variables for the chat template,
such as `thinking` / `enable_thinking`, as vLLM and SGLang accept them) and the reply's text turned into
message fields and stream deltas, split into `reasoning_content` and `content` where the model reasons."""

from __future__ import annotations

from specserve.server.errors import bad, show
from specserve.server.reasoning import ReasoningSplitter

# Variables the server itself gives the template: a request may not set them through chat_template_kwargs.
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def parse_template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad(
            f"chat_template_kwargs must be an object of template variables, got {show(kwargs)}", "chat_template_kwargs"
        )
    taken = [k for k in kwargs if k in RESERVED_TEMPLATE_VARIABLES]
    if taken:
        raise bad(
            f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do", "chat_template_kwargs"
        )
    for name in ("thinking", "enable_thinking"):
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise bad(
                f"chat_template_kwargs.{name} must be a boolean, got {show(kwargs[name])}", "chat_template_kwargs"
            )
    return kwargs


def chat_pieces(text: str, splitter: ReasoningSplitter | None, final: bool) -> list[dict]:
    """A text delta of a reply as stream deltas: reasoning and content each their own."""
    if splitter is None:
        return [{"content": text}] if text else []
    reasoning, content = splitter.push(text)
    if final:
        r, c = splitter.finish()
        reasoning, content = reasoning + r, content + c
    return [d for d in ({"reasoning_content": reasoning}, {"content": content}) if next(iter(d.values()))]


def split_message(message: dict, splitter: ReasoningSplitter) -> None:
    """A whole reply's message with its reasoning moved to reasoning_content (left out when it has none)."""
    reasoning, message["content"] = splitter.split(message["content"])
    if reasoning is not None:
        message["reasoning_content"] = reasoning
