"""TLS, mutual TLS and bearer-token authentication of the standalone gRPC server (and the bearer
token of the HTTP API: `read_token`, `bearer_ok`, used by cluster/openai_api.py).

    security = GRPCSecurity(tls_cert_file="server.pem", tls_key_file="server.key", token_file="token")
    server = await serve_grpc(servicer, 9000, "0.0.0.0", security=security)

Every call but the standard health service (open to probes) must carry ``authorization: Bearer
<token>``, compared in constant time; else UNAUTHENTICATED. The token comes from a file or an
environment variable, never from a command-line literal (``ps`` shows those). Serve's gRPC proxy
has no TLS and no interceptors: the Serve deployment (cluster/app.py) checks the same token itself
(`token_denial`). docs/SERVING.md, "Security".
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from viasd.actors.rpc import read_file
from viasd.config import validate_named
from viasd.errors import InvalidParameterError

TOKEN_ENV = "VIASD_API_TOKEN"
AUTH_KEY = "authorization"  # gRPC metadata keys are lower case
OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # method prefixes served without a token


class GRPCSecurity(BaseModel):
    """Transport security and authentication of the standalone gRPC server (all off by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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

    @classmethod
    def parse(cls, values: dict[str, Any] | None = None, **overrides: Any) -> GRPCSecurity:
        """Validate, raising InvalidParameterError that names the bad field."""
        return validate_named(cls, {**(values or {}), **overrides})

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

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        token = self.token()
        return [BearerTokenInterceptor(token)] if token else []

    def describe(self) -> str:
        """One line for the server's log: what protects the port (never the token itself)."""
        tls = "plaintext"
        if self.tls:
            tls = (
                "mutual TLS"
                if self.require_client_cert
                else "TLS" + (" (client certs optional)" if self.client_ca_file else "")
            )
        source = f"file {self.token_file}" if self.token_file else f"env {self.token_env}"
        auth = f"bearer token from {source}" if self.token() else "no authentication"
        return f"{tls}, {auth}"


def read_token(token_file: str | Path | None, token_env: str | None, field: str = "token_file") -> str | None:
    """A bearer token from a file (surrounding whitespace ignored), else from the environment
    variable `token_env`; None when neither is set: authentication off."""
    if token_file is not None:
        path = Path(token_file)
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise InvalidParameterError(field, f"cannot read {path}: {exc.strerror}") from None
        if not token:
            raise InvalidParameterError(field, f"{path} is empty")
        return token
    if token_env:
        return os.environ.get(token_env, "").strip() or None
    return None


def bearer_ok(presented: str | bytes | None, token: str) -> bool:
    """Whether an ``authorization`` value is ``Bearer <token>``, compared in constant time."""
    if isinstance(presented, str):
        presented = presented.encode()
    return presented is not None and hmac.compare_digest(presented, f"Bearer {token}".encode())


def token_denial(metadata, token: str) -> str | None:
    """Why a gRPC call with this invocation metadata ((key, value) pairs) is refused — "missing
    bearer token" or "invalid bearer token" — or None when it carries ``Bearer <token>``."""
    presented = next((v for k, v in metadata or () if k == AUTH_KEY), None)
    if bearer_ok(presented, token):
        return None
    return "missing bearer token" if presented is None else "invalid bearer token"


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call whose ``authorization`` metadata is not ``Bearer <token>`` with
    UNAUTHENTICATED (the health service excepted, see OPEN_SERVICES)."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("an empty bearer token would let every caller in")
        self._token = token

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if (handler_call_details.method or "").startswith(OPEN_SERVICES) or handler is None:  # (None: UNIMPLEMENTED)
            return handler
        denial = token_denial(handler_call_details.invocation_metadata, self._token)
        return handler if denial is None else _denying(handler, denial)


def _denying(handler: grpc.RpcMethodHandler, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts with UNAUTHENTICATED."""

    async def deny(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(
        deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
