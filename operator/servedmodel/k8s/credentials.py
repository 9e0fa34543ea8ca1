"""Where the API server is and how to prove who we are: kubeconfig or the in-cluster service account.

Supported: bearer token (inline, tokenFile, or the service account's rotating token), client
certificates (file or inline data), basic auth, a CA bundle (file or inline data) or
insecure-skip-tls-verify. Exec and auth-provider plugins are not: they run programs, and an
operator's credentials should not depend on a binary in its image.
"""

from __future__ import annotations

import base64
import contextlib
import os
import ssl
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Bound service-account tokens rotate (kubelet refreshes the file well before expiry); re-read this often.
TOKEN_FILE_REFRESH_S = 60.0


class CredentialsError(Exception):
    """The kubeconfig or service account cannot be used."""


@dataclass
class Credentials:
    """One API server and one identity. Build with `load_credentials()`."""

    server: str
    token: str | None = None
    token_file: Path | None = None
    username: str | None = None
    password: str | None = None
    ca_file: Path | None = None
    ca_data: str | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    cert_data: bytes | None = None
    key_data: bytes | None = None
    insecure_skip_tls_verify: bool = False
    namespace: str | None = None
    source: str = ""
    _file_token: str | None = field(default=None, repr=False)
    _file_token_read_at: float = field(default=0.0, repr=False)

    def __repr__(self) -> str:  # never print secrets
        return f"Credentials(server={self.server!r}, source={self.source!r})"

    def bearer_token(self) -> str | None:
        """The current token; a token file is re-read every TOKEN_FILE_REFRESH_S (rotation)."""
        if self.token_file is None:
            return self.token
        now = time.monotonic()
        if self._file_token is None or now - self._file_token_read_at > TOKEN_FILE_REFRESH_S:
            try:
                self._file_token = self.token_file.read_text().strip()
            except OSError as e:
                if self._file_token is None:
                    raise CredentialsError(f"cannot read token file {self.token_file}: {e}") from e
            self._file_token_read_at = now
        return self._file_token

    def ssl_context(self) -> ssl.SSLContext | None:
        """TLS settings for https servers; None for plain http (loopback test servers)."""
        if not self.server.startswith("https://"):
            return None
        if self.insecure_skip_tls_verify:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        elif self.ca_file is not None or self.ca_data is not None:
            ctx = ssl.create_default_context(
                cafile=str(self.ca_file) if self.ca_file else None, cadata=self.ca_data
            )
        else:
            ctx = ssl.create_default_context()
        if self.cert_file is not None and self.key_file is not None:
            ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        elif self.cert_data is not None and self.key_data is not None:
            _load_cert_chain_from_data(ctx, self.cert_data, self.key_data)
        return ctx


def _load_cert_chain_from_data(ctx: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    # ssl only loads client certificates from files: write them privately, load, remove at once.
    with tempfile.TemporaryDirectory(prefix="servedmodel-cert-") as tmp:
        cert_path, key_path = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
        for path, data in ((cert_path, cert), (key_path, key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(str(cert_path), str(key_path))


def _b64(value: str, what: str) -> bytes:
    try:
        return base64.b64decode(value, validate=False)
    except ValueError as e:
        raise CredentialsError(f"{what} is not valid base64") from e


def _named(items: Any, name: str, what: str) -> dict[str, Any]:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            body = item.get(what)
            return body if isinstance(body, dict) else {}
    raise CredentialsError(f"kubeconfig has no {what} named {name!r}")


def _merge_kubeconfigs(paths: list[Path]) -> dict[str, Any]:
    """Merge like kubectl: for each named entry and for current-context, the first file wins.

    Each entry remembers its file's folder (`_dir`): relative paths in it are relative to that file.
    """
    merged: dict[str, Any] = {"clusters": [], "users": [], "contexts": []}
    seen: dict[str, set[Any]] = {"clusters": set(), "users": set(), "contexts": set()}
    for path in paths:
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            continue
        except (OSError, yaml.YAMLError) as e:
            raise CredentialsError(f"cannot read kubeconfig {path}: {e}") from e
        if not isinstance(doc, dict):
            raise CredentialsError(f"kubeconfig {path} is not a mapping")
        if doc.get("current-context") and "current-context" not in merged:
            merged["current-context"] = doc["current-context"]
        for key in ("clusters", "users", "contexts"):
            for item in doc.get(key) or []:
                if isinstance(item, dict) and item.get("name") not in seen[key]:
                    seen[key].add(item.get("name"))
                    merged[key].append({**item, "_dir": str(path.parent)})
    return merged


def _entry_dir(items: Any, name: str) -> Path:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            return Path(item.get("_dir", "."))
    return Path(".")


def from_kubeconfig(paths: list[Path], context: str | None = None) -> Credentials:
    """Credentials of `context` (default: current-context) from one or more kubeconfig files."""
    doc = _merge_kubeconfigs(paths)
    context_name = context or doc.get("current-context")
    if not context_name:
        raise CredentialsError(f"no current-context in {', '.join(map(str, paths))}")
    ctx = _named(doc["contexts"], context_name, "context")
    cluster_name, user_name = ctx.get("cluster"), ctx.get("user")
    if not cluster_name:
        raise CredentialsError(f"context {context_name!r} names no cluster")
    cluster = _named(doc["clusters"], cluster_name, "cluster")
    user = _named(doc["users"], user_name, "user") if user_name else {}
    cluster_dir = _entry_dir(doc["clusters"], cluster_name)
    user_dir = _entry_dir(doc["users"], user_name) if user_name else Path(".")

    def rel(base: Path, value: Any) -> Path | None:
        return (base / str(value)) if value else None

    if "exec" in user or "auth-provider" in user:
        raise CredentialsError(
            f"user {user_name!r} uses an exec/auth-provider plugin, which this operator does not run; "
            "use a token or a client certificate"
        )
    server = str(cluster.get("server") or "").rstrip("/")
    if not server:
        raise CredentialsError(f"cluster {cluster_name!r} has no server")
    return Credentials(
        server=server,
        token=user.get("token"),
        token_file=rel(user_dir, user.get("tokenFile")),
        username=user.get("username"),
        password=user.get("password"),
        ca_file=rel(cluster_dir, cluster.get("certificate-authority")),
        ca_data=_b64(cluster["certificate-authority-data"], "certificate-authority-data").decode()
        if cluster.get("certificate-authority-data")
        else None,
        cert_file=rel(user_dir, user.get("client-certificate")),
        key_file=rel(user_dir, user.get("client-key")),
        cert_data=_b64(user["client-certificate-data"], "client-certificate-data")
        if user.get("client-certificate-data")
        else None,
        key_data=_b64(user["client-key-data"], "client-key-data") if user.get("client-key-data") else None,
        insecure_skip_tls_verify=bool(cluster.get("insecure-skip-tls-verify", False)),
        namespace=ctx.get("namespace"),
        source=f"kubeconfig context {context_name!r}",
    )


def in_cluster(sa_dir: Path = SERVICE_ACCOUNT_DIR) -> Credentials:
    """The pod's service account: KUBERNETES_SERVICE_HOST/PORT, the rotating token and the cluster CA."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise CredentialsError("KUBERNETES_SERVICE_HOST/PORT are not set: not running in a pod")
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    token_file = sa_dir / "token"
    if not token_file.exists():
        raise CredentialsError(f"no service account token at {token_file}")
    namespace_file = sa_dir / "namespace"
    ca_file = sa_dir / "ca.crt"
    return Credentials(
        server=f"https://{host}:{port}",
        token_file=token_file,
        ca_file=ca_file if ca_file.exists() else None,
        namespace=namespace_file.read_text().strip() if namespace_file.exists() else None,
        source="in-cluster service account",
    )


def load_credentials(
    kubeconfig: str | os.PathLike[str] | None = None, context: str | None = None
) -> Credentials:
    """Like kubectl/kopf: an explicit path, else $KUBECONFIG, else the in-cluster service account,
    else ~/.kube/config."""
    if kubeconfig is not None:
        return from_kubeconfig([Path(kubeconfig)], context)
    env = os.environ.get("KUBECONFIG")
    if env:
        return from_kubeconfig([Path(p) for p in env.split(os.pathsep) if p], context)
    with contextlib.suppress(CredentialsError):
        return in_cluster()
    default = Path.home() / ".kube" / "config"
    if default.exists():
        return from_kubeconfig([default], context)
    raise CredentialsError("no credentials: set KUBECONFIG, run in a pod, or create ~/.kube/config")
