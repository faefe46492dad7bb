"""--root-path, vLLM's: the server runs behind a proxy that serves it under a path prefix
(`/llm`). The app then answers both `/llm/v1/...` (a proxy that passes the prefix on)
and `/v1/...` (one that strips it), as FastAPI's root_path does, and whatever checks
a request's path (the API key, the drain) must look at it without the prefix."""
from __future__ import annotations

from starlette.types import Scope


def route_path(scope: Scope) -> str:
    """The path a request names, less the root path where it starts with it."""
    path: str = scope["path"]
    root = scope.get("root_path", "").rstrip("/")
    if root and (path == root or path.startswith(f"{root}/")):
        return path[len(root):] or "/"
    return path
