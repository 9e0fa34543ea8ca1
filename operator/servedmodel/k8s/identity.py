"""Who the operator is to the API server: one identity for our client and for kopf's watches.

The kubeconfig or the pod's service account is read by lightkube (`lightkube.KubeConfig`); this module
only turns lightkube's user entry into a *token source* both consumers ask for the current credential:

- our client (k8s/client.py) sets the Authorization header of each request from it, and on a 401 asks
  once for a fresh one;
- kopf's login handler (handlers/startup.py, ``@kopf.on.login``) returns ``Identity.connection()`` as a
  ``kopf.ConnectionInfo`` with an expiration, so kopf logs in again through the same source when the
  token expires or the server answers 401.

Token sources (what kubectl supports, as an operator running outside the cluster meets them):
- a static ``token`` (``oc login`` writes one), ``username``/``password`` (basic);
- ``tokenFile`` and the in-cluster service account's rotating bound token, re-read every
  TOKEN_FILE_REFRESH_S (the kubelet rewrites it long before it expires), and on a 401;
- an ``exec`` plugin (EKS ``aws eks get-token``, GKE ``gke-gcloud-auth-plugin``, AKS/OIDC ``kubelogin``):
  run with KUBERNETES_EXEC_INFO (interactive: false), its ExecCredential's token cached until
  ``expirationTimestamp`` (minus a margin), re-run on a 401. apiVersions v1, v1beta1 and v1alpha1;
- ``auth-provider: oidc`` (the deprecated in-tree OIDC provider): its ``id-token``, valid until the JWT's
  ``exp``. Refreshing with the refresh-token is not done here: an expired token is a clear error naming
  ``kubectl oidc-login`` (kubelogin), the exec plugin that replaced it. Other auth-providers (gcp,
  azure) were removed from Kubernetes in 1.26; their error names the replacement exec plugins.

Client certificates and the CA are TLS settings (``ssl_context()``), not tokens.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import os
import ssl
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final, Protocol

import msgspec
from lightkube import ConfigError, KubeConfig
from lightkube.config.client_adapter import verify_cluster
from lightkube.config.kubeconfig import SingleConfig
from lightkube.config.models import User, UserExec

SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_FILE_REFRESH_S: Final = 60.0
EXEC_TIMEOUT_S: Final = 60.0
# Refresh an expiring token this long before it expires (clock skew, requests in flight).
EXPIRY_MARGIN_S: Final = 30.0
EXEC_API_VERSIONS: Final = (
    "client.authentication.k8s.io/v1",
    "client.authentication.k8s.io/v1beta1",
    "client.authentication.k8s.io/v1alpha1",
)


class CredentialsError(Exception):
    """The kubeconfig, service account or plugin cannot give a usable credential (message says why)."""


@dataclass(frozen=True)
class Credential:
    """What goes into the Authorization header, and until when it is good (None: until a 401)."""

    token: str | None = None
    username: str | None = None
    password: str | None = None
    expiration: datetime | None = None

    def __repr__(self) -> str:  # never print secrets
        return f"Credential(expiration={self.expiration!r})"

    def header(self) -> str | None:
        if self.token:
            return f"Bearer {self.token}"
        if self.username is not None:
            raw = f"{self.username}:{self.password or ''}".encode()
            return f"Basic {base64.b64encode(raw).decode()}"
        return None


class TokenSource(Protocol):
    async def get(self, *, refresh: bool = False) -> Credential:
        """The current credential; refresh=True after the server rejected the last one (401)."""
        ...


@dataclass
class StaticToken:
    credential: Credential

    async def get(self, *, refresh: bool = False) -> Credential:
        return self.credential


@dataclass
class TokenFile:
    """A bearer token in a file that something else rotates (kubelet, a sidecar)."""

    path: Path
    refresh_s: float = TOKEN_FILE_REFRESH_S
    _cached: Credential | None = field(default=None, repr=False)
    _read_at: float = 0.0

    async def get(self, *, refresh: bool = False) -> Credential:
        now = time.monotonic()
        if refresh or self._cached is None or now - self._read_at >= self.refresh_s:
            try:
                token = self.path.read_text().strip()
            except OSError as e:
                if self._cached is None:
                    raise CredentialsError(f"cannot read token file {self.path}: {e}") from e
            else:
                expires = datetime.now(UTC) + timedelta(seconds=self.refresh_s)
                self._cached, self._read_at = Credential(token=token, expiration=expires), now
        assert self._cached is not None
        return self._cached


@dataclass
class ExecPlugin:
    """A kubeconfig `exec` user: runs the plugin, caches its ExecCredential until it expires."""

    spec: UserExec
    cwd: Path | None = None
    timeout_s: float = EXEC_TIMEOUT_S
    _cached: Credential | None = field(default=None, repr=False)
    _fetched_at: float = 0.0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def _fresh(self, credential: Credential | None) -> bool:
        if credential is None:
            return False
        if credential.expiration is None:
            return True
        return datetime.now(UTC) < credential.expiration - timedelta(seconds=EXPIRY_MARGIN_S)

    async def get(self, *, refresh: bool = False) -> Credential:
        async with self._lock:  # one plugin run at a time; the others take its result
            stale = self._cached
            just_run = time.monotonic() - self._fetched_at < 1.0
            if stale is not None and (just_run or not refresh) and self._fresh(stale):
                return stale  # fresh, or another request's 401 has just re-run the plugin
            self._cached = await self._run()
            self._fetched_at = time.monotonic()
            return self._cached

    async def _run(self) -> Credential:
        spec = self.spec
        if spec.apiVersion not in EXEC_API_VERSIONS:
            raise CredentialsError(
                f"exec plugin {spec.command}: apiVersion {spec.apiVersion} is not supported"
            )
        env = dict(os.environ)
        env.update((v.name, v.value) for v in spec.env or [])
        env["KUBERNETES_EXEC_INFO"] = json.dumps(
            {"apiVersion": spec.apiVersion, "kind": "ExecCredential", "spec": {"interactive": False}}
        )
        try:
            proc = await asyncio.create_subprocess_exec(
                spec.command,
                *(spec.args or []),
                env=env,
                cwd=self.cwd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as e:
            hint = f" ({spec.installHint.strip()})" if spec.installHint else ""
            raise CredentialsError(f"exec plugin {spec.command} cannot run: {e}{hint}") from e
        try:
            async with asyncio.timeout(self.timeout_s):
                out, err = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise CredentialsError(
                f"exec plugin {spec.command} did not answer in {self.timeout_s:.0f}s"
            ) from None
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip()[-300:]
            raise CredentialsError(f"exec plugin {spec.command} exited {proc.returncode}: {tail}")
        try:
            status = json.loads(out)["status"]
            token = str(status["token"])
        except (ValueError, KeyError, TypeError) as e:
            raise CredentialsError(
                f"exec plugin {spec.command} printed no ExecCredential with status.token"
            ) from e
        expires = _parse_time(status.get("expirationTimestamp"))
        return Credential(token=token, expiration=expires)


@dataclass
class OIDCProvider:
    """`auth-provider: oidc`: the id-token, good until its `exp`."""

    id_token: str

    async def get(self, *, refresh: bool = False) -> Credential:
        expires = _jwt_expiry(self.id_token)
        if refresh or (expires is not None and expires <= datetime.now(UTC)):
            raise CredentialsError(
                "the OIDC id-token of the kubeconfig has expired (or was rejected); the operator does not "
                "refresh it: use the kubelogin exec plugin (`kubectl oidc-login`), or log in again"
            )
        return Credential(token=self.id_token, expiration=expires)


def _parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _jwt_expiry(token: str) -> datetime | None:
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        return datetime.fromtimestamp(int(claims["exp"]), UTC)
    except (IndexError, ValueError, KeyError, TypeError, binascii.Error):
        return None


def _token_source(user: User | None, base: Path | None) -> TokenSource | None:
    if user is None:
        return None
    if user.token_file:
        path = Path(user.token_file)
        return TokenFile(path if path.is_absolute() or base is None else base / path)
    if user.token:
        return StaticToken(Credential(token=user.token.strip()))
    if user.exec is not None:
        return ExecPlugin(user.exec, cwd=base)
    if user.auth_provider:
        name = str(user.auth_provider.get("name") or "")
        config = user.auth_provider.get("config") or {}
        if name == "oidc" and config.get("id-token"):
            return OIDCProvider(str(config["id-token"]))
        raise CredentialsError(
            f"auth-provider {name!r} is not supported (removed from Kubernetes 1.26): use its exec plugin "
            "(gke-gcloud-auth-plugin, kubelogin)"
        )
    if user.username is not None:
        return StaticToken(Credential(username=user.username, password=user.password))
    return None


@dataclass
class Connection:
    """Everything kopf's ConnectionInfo needs (handlers/startup.py maps it field by field)."""

    server: str
    ca_path: str | None
    ca_data: str | None
    insecure: bool
    certificate_path: str | None
    certificate_data: str | None
    private_key_path: str | None
    private_key_data: str | None
    credential: Credential
    default_namespace: str


@dataclass
class Identity:
    """One API server and how to authenticate to it. Build with `load_identity()`."""

    config: SingleConfig
    source: str
    tokens: TokenSource | None

    def __repr__(self) -> str:
        return f"Identity(server={self.server!r}, source={self.source!r})"

    @property
    def server(self) -> str:
        return self.config.cluster.server.rstrip("/")

    @property
    def namespace(self) -> str:
        return self.config.namespace

    def tls_config(self) -> SingleConfig:
        """The config with only TLS material in its user (lightkube must not add its own Authorization)."""
        user = self.config.user
        if user is None:
            return self.config
        tls_user = User(
            client_cert=_abs(self.config, user.client_cert),
            client_cert_data=user.client_cert_data,
            client_key=_abs(self.config, user.client_key),
            client_key_data=user.client_key_data,
        )
        return self.config._replace(user=tls_user)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The CA, client certificate and verification lightkube derives from the config (None: http)."""
        if not self.server.startswith("https://"):
            return None
        config = self.tls_config()
        return verify_cluster(config.cluster, config.user or User(), config.abs_file, trust_env=False)

    async def credential(self, *, refresh: bool = False) -> Credential:
        if self.tokens is None:
            return Credential()
        return await self.tokens.get(refresh=refresh)

    async def connection(self, *, refresh: bool = False) -> Connection:
        cluster, user = self.config.cluster, self.config.user or User()
        return Connection(
            server=self.server,
            ca_path=_abs(self.config, cluster.certificate_auth),
            ca_data=cluster.certificate_auth_data,
            insecure=cluster.insecure,
            certificate_path=_abs(self.config, user.client_cert),
            certificate_data=user.client_cert_data,
            private_key_path=_abs(self.config, user.client_key),
            private_key_data=user.client_key_data,
            credential=await self.credential(refresh=refresh),
            default_namespace=self.namespace,
        )


def _abs(config: SingleConfig, path: str | None) -> str | None:
    return str(config.abs_file(path)) if path else None


def _base_dir(config: SingleConfig) -> Path | None:
    return config.fname.parent if config.fname is not None else None


def from_config(config: KubeConfig, source: str, context: str | None = None) -> Identity:
    try:
        single = config.get(context)
    except (ConfigError, KeyError) as e:
        raise CredentialsError(f"{source}: {e}") from e
    assert single is not None
    return Identity(
        single, f"{source}, context {single.context_name!r}", _token_source(single.user, _base_dir(single))
    )


def load_identity(kubeconfig: str | os.PathLike[str] | None = None, context: str | None = None) -> Identity:
    """Like kubectl and kopf: an explicit kubeconfig, else $KUBECONFIG (its first file), else the pod's
    service account, else ~/.kube/config."""
    paths: list[Path] = []
    if kubeconfig is not None:
        paths = [Path(kubeconfig)]
    elif os.environ.get("KUBECONFIG"):
        paths = [Path(p) for p in os.environ["KUBECONFIG"].split(os.pathsep) if p]
    if not paths and os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            return from_config(
                KubeConfig.from_service_account(str(SERVICE_ACCOUNT_DIR)), "in-cluster service account"
            )
        except (ConfigError, OSError, KeyError) as e:
            raise CredentialsError(f"in-cluster service account: {e}") from e
    if not paths:
        paths = [Path.home() / ".kube" / "config"]
    existing = [p for p in paths if p.expanduser().is_file()]
    if not existing:
        raise CredentialsError(
            f"no kubeconfig at {', '.join(map(str, paths))}: "
            "set KUBECONFIG, run in a pod, or create ~/.kube/config"
        )
    path = existing[0]
    try:
        config = KubeConfig.from_file(path)
    except (ConfigError, OSError, ValueError, msgspec.ValidationError) as e:
        raise CredentialsError(f"kubeconfig {path}: {e}") from e
    return from_config(config, f"kubeconfig {path}", context)
