"""A streamed chat completion read on a thread through the official openai client: the
witness of the fault tests, whose text, token count, end and error are checked after."""
from __future__ import annotations

import threading
import time

import openai


class StreamedChat(threading.Thread):
    """Starts at once; `request` is the create() arguments, stream options aside."""

    def __init__(self, url: str, request: dict) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        self.request = request
        self.text = ""
        self.tokens = 0  # completion tokens, from the usage chunk
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.failed_at: float | None = None
        self.first_token = threading.Event()  # set by the first text, or by the end
        self.start()

    def run(self) -> None:
        try:
            chunks = self.client.chat.completions.create(**self.request, stream=True,
                                                         stream_options={"include_usage": True})
            for chunk in chunks:
                if chunk.usage is not None:
                    self.tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.delta.content:
                        self.text += choice.delta.content
                        self.first_token.set()
                    self.finish_reason = choice.finish_reason or self.finish_reason
        except BaseException as exc:
            self.error, self.failed_at = exc, time.monotonic()
        finally:
            self.first_token.set()

    def completed(self, timeout_s: float = 300) -> bool:
        """Ended whole: no error, and all of its max_tokens (the requests ignore EOS)."""
        self.join(timeout_s)
        return self.error is None and (self.finish_reason, self.tokens) == ("length", self.request["max_tokens"])


def in_flight(url: str, requests: list[dict]) -> list[StreamedChat]:
    """Streams that have each received a token: all of them in flight."""
    streams = [StreamedChat(url, request) for request in requests]
    for stream in streams:
        assert stream.first_token.wait(120)
    return streams
