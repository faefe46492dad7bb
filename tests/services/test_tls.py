"""TLS on the internal plane, from the roles' flags: a RoleServer with a certificate
serves only TLS; kvfleet's channels verify it against the CA; with
--tls-require-client-cert only callers holding a certificate from that CA get in
(mutual TLS). Certificates come from the openssl command line, made per test session."""
from __future__ import annotations

import argparse
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.config import ConfigError
from services.transport import tls
from services.transport.channel import open_channel
from services.transport.server import RoleServer

MAKE_CERTIFICATES = """
set -e
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=kvfleet-test-ca
for name in server client; do
  openssl req -newkey rsa:2048 -nodes -keyout $name.key -out $name.csr -subj /CN=$name
  printf 'subjectAltName=IP:127.0.0.1\\n' > $name.ext
  openssl x509 -req -in $name.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $name.pem -days 2 -extfile $name.ext
done
"""


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates with")
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["bash", "-c", MAKE_CERTIFICATES], cwd=folder, check=True, capture_output=True)
    return folder


def _flags(folder: Path | None, identity: str | None = None, ca: bool = True, require_client_cert: bool = False
           ) -> argparse.Namespace:
    return argparse.Namespace(
        tls_cert_file=folder / f"{identity}.pem" if identity else None,
        tls_key_file=folder / f"{identity}.key" if identity else None,
        tls_ca_file=folder / "ca.pem" if folder and ca else None, tls_require_client_cert=require_client_cert)


@pytest.fixture(autouse=True)
def plain_afterwards() -> Iterator[None]:
    yield
    tls.configure_tls(_flags(None))


def _serve(folder: Path, require_client_cert: bool) -> RoleServer:
    def register(server: grpc.Server) -> None:
        echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Echo": echo}),))

    tls.configure_tls(_flags(folder, "server", require_client_cert=require_client_cert))
    server = RoleServer("127.0.0.1:0", "test.Echo", register, max_workers=2)
    server.start()
    return server


def _echo(channel: grpc.Channel) -> bytes:
    return channel.unary_unary("/test.Echo/Echo")(b"x", timeout=5)


def test_a_tls_role_serves_tls_only(certificates: Path) -> None:
    server = _serve(certificates, require_client_cert=False)
    try:
        tls.configure_tls(_flags(certificates))  # a client: the CA only
        with open_channel(server.address) as channel:
            assert _echo(channel) == b"x"
        with grpc.insecure_channel(server.address) as plain, pytest.raises(grpc.RpcError) as refused:
            _echo(plain)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_mutual_tls_takes_callers_with_a_certificate_of_the_ca_only(certificates: Path) -> None:
    server = _serve(certificates, require_client_cert=True)
    try:
        tls.configure_tls(_flags(certificates))  # no certificate of its own
        with open_channel(server.address) as channel, pytest.raises(grpc.RpcError) as refused:
            _echo(channel)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        tls.configure_tls(_flags(certificates, "client"))
        with open_channel(server.address) as channel:
            assert _echo(channel) == b"x"
    finally:
        server.stop(0)


def test_inconsistent_flags_are_a_config_error(certificates: Path) -> None:
    lone_certificate = _flags(certificates, "server")
    lone_certificate.tls_key_file = None
    with pytest.raises(ConfigError, match="go together"):
        tls.configure_tls(lone_certificate)
    with pytest.raises(ConfigError, match="needs --tls-ca-file"):
        tls.configure_tls(_flags(certificates, "server", ca=False, require_client_cert=True))


def test_a_worker_role_with_mutual_tls_serves_its_scheduler(certificates: Path) -> None:
    from kvfleet.processes import free_port
    from scheduler_svc.worker_client import RemoteWorker

    from servers import RoleProcess

    port = free_port()
    flags = ["--tls-cert-file", str(certificates / "server.pem"), "--tls-key-file", str(certificates / "server.key"),
             "--tls-ca-file", str(certificates / "ca.pem"), "--tls-require-client-cert"]
    worker = RoleProcess("worker", "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "32",
                         "--port", str(port), *flags)
    try:
        tls.configure_tls(_flags(certificates, "client"))
        client = RemoteWorker(f"127.0.0.1:{port}", ready_timeout_s=120)
        assert client.describe().num_kv_blocks == 32
        client.close()
        tls.configure_tls(_flags(certificates))  # the CA, but no certificate to show
        with pytest.raises(Exception, match="unreachable"):  # the handshake fails: never ready
            RemoteWorker(f"127.0.0.1:{port}", ready_timeout_s=3).describe()
    finally:
        worker.kill()
