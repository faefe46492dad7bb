"""What the app serves beyond the OpenAI routes, by vLLM's server flags (services/cli_args.py's add_server_args)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerOptions:
    root_path: str = ""  # --root-path (gateway/root_path.py)
    tokenizer_info: bool = False  # --enable-tokenizer-info-endpoint: GET /tokenizer_info
    load_tracking: bool = False  # --enable-server-load-tracking: GET /load counts (gateway/server_load.py)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerOptions:
        return cls(args.root_path or "", args.enable_tokenizer_info_endpoint, args.enable_server_load_tracking)
