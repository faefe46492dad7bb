"""TLS on the internal plane's gRPC, set by each role's flags at start-up.

--tls-cert-file and --tls-key-file are the process's own certificate: what its server
presents, and what its channels present to servers that ask (mTLS). --tls-ca-file is
what peers' certificates must chain to: a channel verifies servers with it, and a
server given --tls-require-client-cert verifies its callers with it. Without a
certificate a role serves plain gRPC; without a CA its channels dial plain gRPC.
The files' contents are read once, here: a key path on a command line is no secret.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import grpc

from services.config import ConfigError


@dataclass(frozen=True)
class TlsSettings:
    certificate: bytes | None = None
    private_key: bytes | None = None
    ca: bytes | None = None
    require_client_cert: bool = False


_settings = TlsSettings()


def configure_tls(args: argparse.Namespace) -> None:
    """Applies a role's TLS flags to every server and channel this process opens from now on."""
    global _settings
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise ConfigError("--tls-cert-file and --tls-key-file go together")
    if args.tls_require_client_cert and not args.tls_ca_file:
        raise ConfigError("--tls-require-client-cert needs --tls-ca-file to verify the callers with")
    _settings = TlsSettings(
        certificate=args.tls_cert_file.read_bytes() if args.tls_cert_file else None,
        private_key=args.tls_key_file.read_bytes() if args.tls_key_file else None,
        ca=args.tls_ca_file.read_bytes() if args.tls_ca_file else None,
        require_client_cert=args.tls_require_client_cert,
    )


def server_credentials() -> grpc.ServerCredentials | None:
    """None: serve plain gRPC."""
    if _settings.certificate is None:
        return None
    return grpc.ssl_server_credentials([(_settings.private_key, _settings.certificate)],
                                       root_certificates=_settings.ca,
                                       require_client_auth=_settings.require_client_cert)


def channel_credentials() -> grpc.ChannelCredentials | None:
    """None: dial plain gRPC."""
    if _settings.ca is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_settings.ca, private_key=_settings.private_key,
                                        certificate_chain=_settings.certificate)
