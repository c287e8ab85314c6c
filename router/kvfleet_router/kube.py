"""The router's Kubernetes client: in-cluster or kubeconfig credentials, lists, and watches kept current (aiohttp)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import os
import random
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import yaml

log = logging.getLogger(__name__)
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD_S = 60.0  # projected service-account tokens rotate (hourly); client-go re-reads the file as often
LIST_PAGE = 500
LIST_TIMEOUT = aiohttp.ClientTimeout(total=60.0, sock_connect=10.0)
WATCH_S = (240, 480)  # a watch's timeoutSeconds, drawn per watch so many routers do not reconnect in step
BACKOFF_S = (0.5, 10.0)  # first retry and cap: RBAC granted late is noticed within seconds
MAX_EVENT_BYTES = 16 << 20
UNSUPPORTED_USER_KEYS = ("exec", "auth-provider", "username", "password")


class KubeConfigError(ValueError):
    """No usable credentials; the message names the file and the field."""


class KubeError(Exception):
    """A non-2xx answer of the apiserver, or a watch's ERROR event, with its HTTP status code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


@dataclass(frozen=True)
class KubeConfig:
    """Where the apiserver is and how the router proves who it is."""

    server: str  # https://host:port[/prefix], no trailing slash: API paths are appended
    ssl: ssl.SSLContext
    source: str  # the kubeconfig file(s) or "in-cluster", for messages
    token: str | None = None
    token_file: Path | None = None  # re-read while running (rotated tokens)


def own_namespace(env: Mapping[str, str], sa_dir: Path = SA_DIR) -> str | None:
    """The router's own namespace: the service account's namespace file, else $POD_NAMESPACE."""
    with contextlib.suppress(OSError):
        if name := (sa_dir / "namespace").read_text().strip():
            return name
    return env.get("POD_NAMESPACE") or None


def load_config(kubeconfig: str | None, env: Mapping[str, str], sa_dir: Path = SA_DIR) -> KubeConfig:
    """--kubeconfig, else $KUBECONFIG (a list, merged first-wins as kubectl does), else the pod's service account."""
    if kubeconfig:
        return from_kubeconfig([Path(kubeconfig)], must_exist=True)
    if env.get("KUBECONFIG"):
        return from_kubeconfig([Path(p) for p in env["KUBECONFIG"].split(os.pathsep) if p], must_exist=False)
    config = in_cluster(env, sa_dir)
    if config is None:
        raise KubeConfigError(f"no Kubernetes credentials: pass --kubeconfig PATH, set $KUBECONFIG, or run in a pod "
                              f"with a service account ($KUBERNETES_SERVICE_HOST/PORT and {sa_dir}/token)")
    return config


def in_cluster(env: Mapping[str, str], sa_dir: Path = SA_DIR) -> KubeConfig | None:
    """The pod's service account (None outside a pod): the apiserver's Service address from the environment."""
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port or not (sa_dir / "token").is_file():
        return None
    host = f"[{host}]" if ":" in host else host  # IPv6
    context = _ssl_context("in-cluster", ca_file=str(sa_dir / "ca.crt"))
    return KubeConfig(f"https://{host}:{port}", context, "in-cluster", token_file=sa_dir / "token")


def from_kubeconfig(paths: list[Path], must_exist: bool) -> KubeConfig:
    """The current context of kubeconfig files; relative paths in an entry are relative to its own file."""
    current = ""  # the first file that sets it wins, as for every named entry below
    # kind → name → (entry, the directory of the file that defined it)
    tables: dict[str, dict[str, tuple[dict[str, Any], Path]]] = {"clusters": {}, "users": {}, "contexts": {}}
    read: list[str] = []
    for path in paths:
        try:
            doc = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            if must_exist:
                raise KubeConfigError(f"{path}: no such file") from None
            continue
        except (OSError, yaml.YAMLError) as e:
            raise KubeConfigError(f"{path}: {e}") from None
        if not isinstance(doc, dict):
            raise KubeConfigError(f"{path}: not a kubeconfig (expected a mapping)")
        read.append(str(path))
        current = current or str(doc.get("current-context") or "")
        for key, table in tables.items():
            for item in doc.get(key) or []:
                if isinstance(item, dict) and item.get("name"):
                    table.setdefault(str(item["name"]), (item.get(key[:-1]) or {}, path.parent))
    source = os.pathsep.join(read)
    if not read:
        raise KubeConfigError(f"none of the kubeconfig files exists: {', '.join(map(str, paths))}")
    if not current or current not in tables["contexts"]:
        raise KubeConfigError(f"{source}: current-context {current!r} is not among the contexts")
    context, _ = tables["contexts"][current]
    if context.get("cluster") not in tables["clusters"]:
        raise KubeConfigError(f"{source}: context {current!r} names cluster {context.get('cluster')!r}, not defined")
    cluster, cluster_dir = tables["clusters"][context["cluster"]]
    user, user_dir = tables["users"].get(str(context.get("user") or ""), ({}, Path(".")))
    where = f"{source}: user {context.get('user')!r}"
    if bad := [k for k in UNSUPPORTED_USER_KEYS if user.get(k)]:
        raise KubeConfigError(f"{where} authenticates with {bad[0]}, which kvfleet-router does not support "
                              "(use a token, a tokenFile or a client certificate)")
    server = str(cluster.get("server") or "").rstrip("/")
    if not server.startswith(("https://", "http://")):
        raise KubeConfigError(f"{source}: cluster {context['cluster']!r} has no https:// server")
    context_ssl = _ssl_context(
        f"{source}: cluster {context['cluster']!r} / user {context.get('user')!r}",
        ca_file=_path(cluster, "certificate-authority", cluster_dir),
        ca_data=_data(cluster, "certificate-authority-data", source),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        cert=_path(user, "client-certificate", user_dir) or _data(user, "client-certificate-data", where),
        key=_path(user, "client-key", user_dir) or _data(user, "client-key-data", where))
    token_file = _path(user, "tokenFile", user_dir)
    return KubeConfig(server, context_ssl, source, token=str(user["token"]) if user.get("token") else None,
                      token_file=Path(token_file) if token_file else None)


def _path(entry: dict[str, Any], key: str, base: Path) -> str | None:
    return str(base / str(entry[key])) if entry.get(key) else None


def _data(entry: dict[str, Any], key: str, where: str) -> bytes | None:
    if not entry.get(key):
        return None
    try:
        return base64.b64decode(str(entry[key]), validate=True)
    except (binascii.Error, ValueError):
        raise KubeConfigError(f"{where}: {key} is not base64") from None


def _ssl_context(where: str, ca_file: str | None = None, ca_data: bytes | None = None, insecure: bool = False,
                 cert: str | bytes | None = None, key: str | bytes | None = None) -> ssl.SSLContext:
    """A TLS context trusting the cluster's CA (the system's when none is named), with the client certificate."""
    try:
        context = ssl.create_default_context(cafile=ca_file, cadata=ca_data.decode() if ca_data else None)
        if insecure:
            log.warning("%s: insecure-skip-tls-verify: the apiserver's certificate is not checked", where)
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        if (cert is None) != (key is None):
            raise KubeConfigError(f"{where}: a client certificate needs both its certificate and its key")
        if cert is not None and key is not None:
            # ssl loads a certificate chain from files only: -data goes through a directory only we can read (0700).
            with tempfile.TemporaryDirectory() as tmp:
                files = [x if isinstance(x, str) else _written(Path(tmp) / name, x)
                         for name, x in (("cert.pem", cert), ("key.pem", key))]
                context.load_cert_chain(files[0], files[1])
    except (ssl.SSLError, OSError, UnicodeDecodeError) as e:
        raise KubeConfigError(f"{where}: {e}") from None
    return context


def _written(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


class Store(Protocol):
    """What a list-watch keeps current: the whole collection after a list, then each change."""

    def replace(self, items: list[dict[str, Any]]) -> None: ...

    def apply(self, kind: str, obj: dict[str, Any]) -> None: ...


class KubeClient:
    """Lists and watches over one aiohttp session: `async with KubeClient(config) as client`."""

    def __init__(self, config: KubeConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self._token, self._token_read = config.token, -TOKEN_REREAD_S

    async def __aenter__(self) -> KubeClient:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.config.ssl))
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def _headers(self) -> dict[str, str]:
        file = self.config.token_file
        if file is not None and time.monotonic() - self._token_read >= TOKEN_REREAD_S:
            try:
                self._token = (await asyncio.to_thread(file.read_text)).strip()
            except OSError as e:
                raise KubeError(401, f"cannot read the token file {file}: {e}") from None
            self._token_read = time.monotonic()
        return {"Accept": "application/json", **({"Authorization": f"Bearer {self._token}"} if self._token else {})}

    async def list(self, path: str, selector: str = "") -> tuple[list[dict[str, Any]], str]:
        """Every object at a collection path (page by page) and the resourceVersion to watch from."""
        assert self._session is not None, "use KubeClient as an async context manager"
        items: list[dict[str, Any]] = []
        params = {"limit": str(LIST_PAGE), **({"labelSelector": selector} if selector else {})}
        while True:
            async with self._session.get(self.config.server + path, params=params, headers=await self._headers(),
                                         timeout=LIST_TIMEOUT) as r:
                await _check(r)
                body = await r.json()
            items.extend(body.get("items") or [])
            meta = body.get("metadata") or {}
            if not meta.get("continue"):
                return items, str(meta.get("resourceVersion") or "")
            params["continue"] = meta["continue"]

    @contextlib.asynccontextmanager
    async def watch(self, path: str, selector: str, version: str,
                    timeout_s: int) -> AsyncIterator[AsyncIterator[tuple[str, dict[str, Any]]]]:
        """Connect a watch from `version` (bookmarks on); inside, iterate its (type, object) events."""
        assert self._session is not None, "use KubeClient as an async context manager"
        params = {"watch": "1", "resourceVersion": version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(timeout_s), **({"labelSelector": selector} if selector else {})}
        # No total timeout: a watch is meant to last; a silent connection is cut after the server's own timeout.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=timeout_s + 30.0)
        async with self._session.get(self.config.server + path, params=params, headers=await self._headers(),
                                     timeout=timeout) as r:
            await _check(r)
            yield _events(r)


async def _events(r: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """One JSON event a line (read in chunks: an object may be longer than aiohttp's line limit)."""
    buf = bytearray()
    async for chunk in r.content.iter_any():
        buf += chunk
        while (end := buf.find(b"\n")) >= 0:
            line = bytes(buf[:end])
            del buf[:end + 1]
            if line.strip():
                event = json.loads(line)
                yield str(event.get("type") or ""), event.get("object") or {}
        if len(buf) > MAX_EVENT_BYTES:
            raise KubeError(500, f"a watch event longer than {MAX_EVENT_BYTES} bytes")


async def _check(r: aiohttp.ClientResponse) -> None:
    if r.status < 300:
        return
    text = await r.text()
    with contextlib.suppress(ValueError, AttributeError):
        text = str(json.loads(text).get("message") or text)
    raise KubeError(r.status, text.strip()[:500])


async def list_watch(client: KubeClient, path: str, selector: str, store: Store, what: str, version: str = "") -> None:
    """Keep `store` equal to the collection at `path`, until cancelled: list (unless resuming from `version`), then
    watch from the list's resourceVersion, resuming each watch where the last one ended (bookmarks keep that version
    fresh); re-list on 410 Gone; back off on any other failure, logging each kind once, not at every attempt."""
    failures, logged = 0, ""

    def healthy() -> None:  # a list, an event or a watch that ran its course: the trouble, if any, is over
        nonlocal failures, logged
        if logged:
            log.info("%s: working again", what)
        failures, logged = 0, ""

    while True:
        try:
            if not version:
                items, version = await client.list(path, selector)
                store.replace(items)
                healthy()
            started, seen = time.monotonic(), 0
            async with client.watch(path, selector, version, random.randint(*WATCH_S)) as events:
                async for kind, obj in events:
                    if kind == "ERROR":  # a Status object: 410 when our version fell out of the watch cache
                        raise KubeError(int(obj.get("code") or 500), str(obj.get("message") or obj))
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    seen += 1
                    if kind != "BOOKMARK":  # a bookmark only moves the version on
                        store.apply(kind, obj)
                    healthy()
            if seen or time.monotonic() - started >= 1.0:  # the server's timeoutSeconds ended it: watch again
                log.debug("%s: the watch ended, resuming at resourceVersion %s", what, version)
                healthy()
                continue
            problem, message = "closed", "the watch ended as soon as it began, with nothing in it"
        except KubeError as e:
            if e.status == 410 and version:  # our version is older than the apiserver keeps: list afresh
                log.info("%s: resourceVersion %s expired (410 Gone), listing again", what, version)
                version = ""
                continue
            problem, message = f"http {e.status}", str(e)
            if e.status == 403:
                message += " (the router's Role is missing or not yet in effect)"
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            problem, message = type(e).__name__, str(e) or type(e).__name__
        failures += 1
        delay = min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (failures - 1)) * random.uniform(0.5, 1.0)
        if problem != logged:
            log.warning("%s: %s; retrying with back-off", what, message)
            logged = problem
        else:
            log.debug("%s: still failing (%s); retry %d in %.1fs", what, message, failures, delay)
        await asyncio.sleep(delay)
