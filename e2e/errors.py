"""Exceptions raised by the local cluster (e2e/cluster.py and its helper modules)."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """The local cluster failed to build, start, become ready or stop."""


class ApiError(ClusterError):
    """The API server answered with an HTTP error status."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body
