"""The server's flags that change what every completion and chat response carries
(vLLM's names). A request's own field, where it has one, decides for itself."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from gateway.protocol import StreamOptions


@dataclass(frozen=True)
class StreamUsage:
    final: bool  # a last chunk, without choices, tells the whole usage
    continuous: bool  # every chunk tells the usage so far (vLLM's continuous_usage_stats)
    cached_details: bool  # the last chunk's usage tells the cached prompt tokens


@dataclass(frozen=True)
class ResponseOptions:
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage tells the cached prompt tokens
    force_include_usage: bool = False  # --enable-force-include-usage: every stream tells its usage, continuously
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: logprobs name tokens "token_id:N"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ResponseOptions:
        return cls(args.enable_prompt_tokens_details, args.enable_force_include_usage, args.return_tokens_as_token_ids)

    def stream_usage(self, stream_options: StreamOptions | None) -> StreamUsage:
        """What a stream tells of its usage, as vLLM decides: the usage so far in every
        chunk only with a last chunk of its own; the flag forces both."""
        if self.force_include_usage:
            return StreamUsage(True, True, self.prompt_tokens_details)
        final = stream_options is not None and bool(stream_options.include_usage)
        return StreamUsage(final, final and bool(stream_options.continuous_usage_stats), self.prompt_tokens_details)

    def tokens_as_ids(self, requested: bool | None) -> bool:
        return self.return_tokens_as_token_ids if requested is None else requested
