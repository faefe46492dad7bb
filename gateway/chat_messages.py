"""OpenAI chat messages as chat templates expect them."""
from __future__ import annotations

import json
from typing import Any

from gateway.errors import bad_request
from gateway.protocol import ChatMessageParam, ToolParam


def message_dicts(messages: list[ChatMessageParam]) -> list[dict[str, Any]]:
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
        if message.tool_calls:
            entry["tool_calls"] = [_template_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def tool_dicts(tools: list[ToolParam] | None) -> list[dict[str, Any]] | None:
    """OpenAI's tool definitions as the chat template reads them."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """A call as templates read it: OpenAI sends arguments as JSON text, templates
    write them with `tojson`, so they get the object (as vLLM hands them)."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            raise bad_request("messages", f"a tool call's arguments are not JSON: {arguments[:80]!r}") from None
    return {**call, "function": function}
