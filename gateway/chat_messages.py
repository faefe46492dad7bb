"""OpenAI chat messages as chat templates expect them."""
from __future__ import annotations

from gateway.errors import bad_request
from gateway.protocol import ChatMessageParam


def message_dicts(messages: list[ChatMessageParam]) -> list[dict[str, str]]:
    if not messages:
        raise bad_request("messages", "messages must not be empty")
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):  # text parts, joined as vLLM does
            content = "\n".join(part.text for part in content)
        entry = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return out
