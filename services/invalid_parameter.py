"""The error of a request parameter with a bad value, named: every front end (SDK, REST,
gRPC) reports which parameter was wrong from the message, which starts with its name."""
from __future__ import annotations


class InvalidParameter(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
