"""A small fake of the Kubernetes API server for the planner's tests: the REST paths of
a Deployment's `scale` subresource (GET and PATCH with a merge patch), as the official
client calls them, each request recorded. No real API server runs on these machines."""
from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

TOKEN = "fake-service-account-token"
SCALE_PATH = "/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale"


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    content_type: str | None
    body: dict | None


class FakeKubeApi:
    def __init__(self, replicas: dict[tuple[str, str], int]) -> None:
        """`replicas`: (namespace, Deployment) -> its count."""
        self.replicas = dict(replicas)
        self.calls: list[Call] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_route("GET", SCALE_PATH, self._scale)
        app.router.add_route("PATCH", SCALE_PATH, self._scale)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _scale(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        body = await request.json() if request.can_read_body else None
        self.calls.append(Call(request.method, request.path, request.headers.get("Content-Type"), body))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"kind": "Status", "code": 401, "reason": "Unauthorized"}, status=401)
        key = (namespace, name)
        if key not in self.replicas:
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404,
                                      "reason": "NotFound", "message": f'deployments.apps "{name}" not found'},
                                     status=404)
        if request.method == "PATCH":
            if request.headers.get("Content-Type") != "application/merge-patch+json":
                return web.json_response({"kind": "Status", "code": 415}, status=415)
            self.replicas[key] = body["spec"]["replicas"]
        count = self.replicas[key]
        return web.json_response({"kind": "Scale", "apiVersion": "autoscaling/v1",
                                  "metadata": {"name": name, "namespace": namespace},
                                  "spec": {"replicas": count}, "status": {"replicas": count}})

    def kubeconfig(self, directory: Path) -> str:
        path = directory / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "planner", "user": {"token": TOKEN}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "planner"}}],
        }))
        return str(path)

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
