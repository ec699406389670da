"""TLS, mutual TLS and bearer-token authentication of the standalone gRPC server (and the bearer
token of the HTTP API and the Serve deployment: `read_token`, `authenticate`).

    security = GRPCSecurity(tls_cert_file="server.pem", tls_key_file="server.key", token_file="token")
    server = await serve_grpc(servicer, 9000, "0.0.0.0", security=security)

Every call but the standard health service (open to probes) must carry ``authorization: Bearer
<token>``, compared in constant time (`authenticate`, which GenerationServicer runs on every call
on either server, and the HTTP API on every route but /health and /metrics); else
UNAUTHENTICATED. The token comes from a file or an environment variable, never from a
command-line literal (``ps`` shows those). docs/SERVING.md, "Security".
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import grpc
from pydantic import Field, model_validator

from viasd.actors.rpc import read_file
from viasd.cluster.handler import UNAUTHENTICATED, RequestError
from viasd.cluster.pipeline import StrictModel
from viasd.errors import InvalidParameterError

TOKEN_ENV = "VIASD_API_TOKEN"
AUTH_KEY = "authorization"  # gRPC metadata keys are lower case


class GRPCSecurity(StrictModel):
    """Transport security and authentication of the standalone gRPC server (all off by default)."""

    tls_cert_file: Path | None = Field(
        None, description="PEM certificate chain the server presents; with tls_key_file it turns TLS on."
    )
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file.")
    client_ca_file: Path | None = Field(
        None, description="PEM CA bundle that verifies client certificates (mutual TLS); needs TLS."
    )
    require_client_cert: bool = Field(
        False, description="Refuse clients that present no certificate signed by client_ca_file (mutual TLS)."
    )
    token_file: Path | None = Field(
        None, description="File holding the bearer token every call must present (surrounding whitespace ignored)."
    )
    token_env: str | None = Field(
        TOKEN_ENV,
        description="Environment variable holding the bearer token when token_file is not set; "
        "None: do not read the environment.",
    )

    @model_validator(mode="after")
    def _check(self) -> GRPCSecurity:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_key_file: TLS needs both tls_cert_file and tls_key_file")
        if self.client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("client_ca_file: mutual TLS needs TLS (tls_cert_file and tls_key_file)")
        if self.require_client_cert and self.client_ca_file is None:
            raise ValueError("require_client_cert: needs client_ca_file to verify client certificates")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    def token(self) -> str | None:
        """The bearer token (from token_file, else token_env), or None: authentication off."""
        return read_token(self.token_file, self.token_env)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials of the server port, or None (plaintext)."""
        if not self.tls:
            return None
        cert, key = read_file(self.tls_cert_file, "tls_cert_file"), read_file(self.tls_key_file, "tls_key_file")
        client_ca = read_file(self.client_ca_file, "client_ca_file") if self.client_ca_file is not None else None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=self.require_client_cert
        )

    def describe(self) -> str:
        """One line for the server's log: what protects the port (never the token itself)."""
        tls = "TLS" + (" (client certs optional)" if self.client_ca_file else "") if self.tls else "plaintext"
        if self.require_client_cert:  # (which needs client_ca_file, which needs TLS)
            tls = "mutual TLS"
        source = f"file {self.token_file}" if self.token_file else f"env {self.token_env}"
        auth = f"bearer token from {source}" if self.token() else "no authentication"
        return f"{tls}, {auth}"


def read_token(token_file: str | Path | None, token_env: str | None, field: str = "token_file") -> str | None:
    """A bearer token from a file (surrounding whitespace ignored), else from the environment
    variable `token_env`; None when neither is set: authentication off."""
    if token_file is not None:
        token = read_file(token_file, field).decode().strip()
        if not token:
            raise InvalidParameterError(field, f"{Path(token_file)} is empty")
        return token
    if token_env:
        return os.environ.get(token_env, "").strip() or None
    return None


def authenticate(presented: str | bytes | None, token: str | None) -> None:
    """RequestError UNAUTHENTICATED unless `presented` (an ``authorization`` header or metadata value)
    is ``Bearer <token>``, compared in constant time; `token` None: authentication off."""
    if token is None:
        return
    if isinstance(presented, str):
        presented = presented.encode()
    if presented is None or not hmac.compare_digest(presented, f"Bearer {token}".encode()):
        raise RequestError(UNAUTHENTICATED, "missing bearer token" if presented is None else "invalid bearer token")
