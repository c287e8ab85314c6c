"""`kvfleet-operator` / `python -m kvfleet_operator`: kopf with our settings, /healthz and /metrics, JSON logs."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Any, cast

import kopf

from kvfleet_operator import handlers, metrics
from kvfleet_operator.config import OperatorConfig
from kvfleet_operator.kube import Kube, default_login
from kvfleet_operator.peering import ensure_peering_object
from kvfleet_operator.state import OperatorState

log = logging.getLogger("kvfleet_operator")


async def run(cfg: OperatorConfig) -> None:
    """Run the operator until it is stopped (SIGINT/SIGTERM are handled by kopf)."""
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.current_task()

    def healthy() -> bool:
        return ready.is_set() and not stop.is_set() and task is not None and not task.done()

    settings = cfg.settings()
    state = OperatorState(cfg, Kube(lambda: default_login(settings)))
    memo = kopf.Memo()
    state.attach(memo)
    runner, port = await metrics.serve(cfg.port, healthy)
    # Beside kopf, not before it: kopf waits (paused) for the object, and /healthz must not wait on the CRD.
    ensure = asyncio.create_task(ensure_peering_object(state.kube, cfg.peering)) if cfg.peering else None
    log.info(f"kvfleet operator: health and metrics on port {port}; namespaces: "
             f"{', '.join(cfg.namespaces) or 'all'}; peering: {cfg.peering or 'standalone'} as {state.identity}")
    try:
        await kopf.operator(
            registry=kopf.get_default_registry(),  # handlers.py registered itself on import
            settings=settings,
            memo=memo,
            clusterwide=cfg.clusterwide,
            namespaces=cfg.namespaces,
            standalone=not cfg.peering,
            peering_name=cfg.peering or None,
            priority=cfg.peering_priority,
            # Ours, not one kopf makes up: the loops beside kopf tell our entry in the peering object by it.
            identity=cast(Any, state.identity),  # kopf types it as a NewType of str it does not export
            ready_flag=ready,
            stop_flag=stop,
        )
    finally:
        if ensure is not None:
            ensure.cancel()
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; every setting comes from the environment (see OperatorConfig.from_env)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args:
        print(f"usage: kvfleet-operator (configured by environment variables)\n\n{OperatorConfig.from_env.__doc__}",
              file=sys.stderr if args not in (["-h"], ["--help"]) else sys.stdout)
        return 0 if args in (["-h"], ["--help"]) else 2
    try:
        cfg = OperatorConfig.from_env()
    except ValueError as e:
        print(f"kvfleet-operator: {e}", file=sys.stderr)
        return 2
    kopf.configure(log_format=kopf.LogFormat.JSON if cfg.log_format == "json" else kopf.LogFormat.FULL,
                   debug=cfg.log_level == "DEBUG", quiet=cfg.log_level in ("WARNING", "ERROR"))
    assert handlers.reconcile  # the import above registers the handlers with kopf's default registry
    asyncio.run(run(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
