"""The cluster's private network: a user+network namespace whose loopback holds the pod IP range.

Pods get IPs from POD_RANGE, which exists only inside this namespace: nothing the agents bind is
visible from the host, and no traffic can leave it (the namespace has no interface but `lo`).
Two byte relays connect it to the host, both over Unix sockets in the run dir (a filesystem path
crosses network namespaces; a TCP port does not):

- API relay: inside, 127.0.0.1:<apiserver port> forwards to the host's API server, so processes
  inside (the process kubelet, agents, the operator) use the very same kubeconfig as the host.
- Gateway: a host process writes "HOST PORT\\n" and is connected to HOST:PORT inside; `forward`
  turns that into a loopback port on the host (what `kubectl port-forward` is to a real cluster).

Run as a script: `inside` (the namespace holder, started under `unshare`), `relay` (host side of
the API relay) and `forward` (a host port for one pod address).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

POD_RANGE = "10.250.0.1/16"  # on lo inside the namespace: every address of the /16 is local there
KWOK_POD_CIDR = "10.250.0.1/17"  # kwok hands these to pods it runs itself (no process behind them)
KUBELET_POD_CIDR = "10.250.128.1/17"  # the process kubelet's agents bind these
READY_LINE = "kvfleet-netns ready"

Connector = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


def script_path() -> Path:
    """This file, for starting its subcommands with the same interpreter."""
    return Path(__file__).resolve()


def nsenter_argv(holder_pid: int, argv: Sequence[str]) -> list[str]:
    """argv run inside the namespace held by holder_pid (same user, same files; only the network differs)."""
    return ["nsenter", f"--target={holder_pid}", "--user", "--net", "--preserve-credentials", "--", *argv]


def unshare_argv(argv: Sequence[str]) -> list[str]:
    """argv run as the holder of a new user+network namespace (needs unprivileged user namespaces)."""
    return ["unshare", "--user", "--map-root-user", "--net", "--", *argv]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy bytes until EOF, then half-close, so TLS close_notify and HTTP/1.1 bodies pass intact."""
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def _splice(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, connect: Connector) -> None:
    """Join one accepted connection to a fresh upstream connection, both ways, until both sides finish."""
    try:
        up_r, up_w = await connect()
    except OSError as exc:
        print(f"relay: upstream connect failed: {exc}", file=sys.stderr, flush=True)
        client_w.close()
        return
    await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))
    for w in (client_w, up_w):
        w.close()


async def _gateway_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Inside end of the gateway: read "HOST PORT", connect there, answer "OK" (or "ERR why"), then splice."""
    try:
        host, port = (await reader.readline()).decode().split()
        up_r, up_w = await asyncio.open_connection(host, int(port))
    except (OSError, ValueError) as exc:
        writer.write(f"ERR {exc}\n".encode())
        await writer.drain()
        writer.close()
        return
    writer.write(b"OK\n")
    await writer.drain()
    await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
    for w in (writer, up_w):
        w.close()


def _setup_loopback(cidr: str) -> None:
    """Bring lo up and put the pod range on it (we are root in our own user namespace)."""
    for argv in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", cidr, "dev", "lo"]):
        subprocess.run(argv, check=True)


async def _run_inside(api_port: int, api_sock: str, gateway_sock: str) -> None:
    async def to_host(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _splice(r, w, lambda: asyncio.open_unix_connection(api_sock))

    api = await asyncio.start_server(to_host, "127.0.0.1", api_port)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(gateway_sock)
    gateway = await asyncio.start_unix_server(_gateway_client, gateway_sock)
    print(READY_LINE, flush=True)
    async with api, gateway:
        await _until_terminated()


async def _run_relay(listen_sock: str, host: str, port: int) -> None:
    async def to_api(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _splice(r, w, lambda: asyncio.open_connection(host, port))

    with contextlib.suppress(FileNotFoundError):
        os.unlink(listen_sock)
    server = await asyncio.start_unix_server(to_api, listen_sock)
    print(READY_LINE, flush=True)
    async with server:
        await _until_terminated()


async def _run_forward(gateway_sock: str, target: str) -> None:
    host, port = target.rsplit(":", 1)

    async def through_gateway() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        r, w = await asyncio.open_unix_connection(gateway_sock)
        w.write(f"{host} {port}\n".encode())
        await w.drain()
        answer = (await r.readline()).decode().strip()
        if answer != "OK":
            w.close()
            raise ConnectionRefusedError(f"{target} inside the namespace: {answer}")
        return r, w

    async def accept(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _splice(r, w, through_gateway)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    print(f"forwarding 127.0.0.1:{server.sockets[0].getsockname()[1]} -> {target}", flush=True)
    async with server:
        await _until_terminated()


async def _until_terminated() -> None:
    """Return on SIGTERM or SIGINT (the harness stops us by pid)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """`inside`, `relay` or `forward` (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    inside = sub.add_parser("inside", help="hold the namespace: pod range on lo, API relay and gateway")
    inside.add_argument("--api-port", type=int, required=True)
    inside.add_argument("--api-sock", required=True, help="Unix socket of the host side of the API relay")
    inside.add_argument("--gateway-sock", required=True)
    inside.add_argument("--cidr", default=POD_RANGE)
    relay = sub.add_parser("relay", help="host side of the API relay: Unix socket -> API server")
    relay.add_argument("--listen-sock", required=True)
    relay.add_argument("--connect", required=True, help="HOST:PORT of the API server")
    fwd = sub.add_parser("forward", help="a loopback port on the host for ADDRESS:PORT inside the namespace")
    fwd.add_argument("--gateway-sock", required=True)
    fwd.add_argument("target", help="ADDRESS:PORT inside the namespace")
    args = parser.parse_args(argv)
    if args.cmd == "inside":
        _setup_loopback(args.cidr)
        asyncio.run(_run_inside(args.api_port, args.api_sock, args.gateway_sock))
    elif args.cmd == "relay":
        host, port = args.connect.rsplit(":", 1)
        asyncio.run(_run_relay(args.listen_sock, host, int(port)))
    else:
        asyncio.run(_run_forward(args.gateway_sock, args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
