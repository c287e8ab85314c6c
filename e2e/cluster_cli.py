"""The `up` and `down` commands of e2e/cluster.py: start a local cluster in the background, stop it by pid."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import netns
from cluster import BUILD_SH, DEFAULT_RUN_DIR, ClusterError, LocalCluster, find_bin_dir, stop_run_dir


def _cmd_up(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    bin_dir = find_bin_dir(build=args.build)
    if bin_dir is None:
        print(f"control-plane binaries are not built; run `bash {BUILD_SH}` or pass --build", file=sys.stderr)
        return 2
    cluster = LocalCluster(run_dir, gpu_nodes=args.gpu_nodes, bin_dir=bin_dir, keep=True, timeout=args.timeout)
    try:
        cluster.start()
    except ClusterError as exc:
        print(f"cluster start failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; components stopped", file=sys.stderr)
        return 130
    timings = ", ".join(f"{k} {v:.1f}s" for k, v in cluster.timings.items() if k != "total")
    print(f"cluster up in {cluster.timings['total']:.1f}s ({timings})")
    print(f"  API server: {cluster.server}; {args.gpu_nodes} fake GPU nodes; logs in {run_dir / 'logs'}")
    print("Use it with:")
    print(f"  export KUBECONFIG={cluster.kubeconfig}")
    if (bin_dir / "kubectl").is_file():
        print(f"  export PATH={bin_dir}:$PATH   # kubectl {bin_dir / 'kubectl'} matches the server")
    print("  kubectl get nodes")
    print("Pod IPs exist only in the cluster's network namespace; a shell there (curl a pod IP, run the operator):")
    print(f"  {' '.join(netns.nsenter_argv(cluster.netns_pid or 0, [os.environ.get('SHELL', 'bash')]))}")
    down = f"python {Path(__file__).with_name('cluster.py')} down"
    down += "" if run_dir == DEFAULT_RUN_DIR else f" --run-dir {run_dir}"
    print(f"Stop it with:\n  {down}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.exists():
        print(f"nothing to stop: {run_dir} does not exist")
        return 0
    if not (run_dir / "pids.json").exists() and not (run_dir / "cluster.json").exists():
        print(f"{run_dir} does not look like a cluster run dir (no pids.json/cluster.json); left alone",
              file=sys.stderr)
        return 1
    stopped = stop_run_dir(run_dir, keep=args.keep)
    print(f"stopped: {', '.join(stopped) or 'nothing was running'}"
          + (f"; kept {run_dir}" if args.keep else f"; removed {run_dir}"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: `up` starts a cluster in the background, `down` stops it."""
    parser = argparse.ArgumentParser(description="Local Kubernetes control plane with fake GPU nodes.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the control plane and fake GPU nodes, then return")
    up.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR), help="certs, kubeconfig, logs, etcd data, pids")
    up.add_argument("--gpu-nodes", type=int, default=2, help="number of fake GPU nodes (default 2)")
    up.add_argument("--timeout", type=float, default=120.0, help="per-component readiness deadline, seconds")
    up.add_argument("--build", action="store_true", help="run e2e/build.sh first if the binaries are missing")
    up.set_defaults(func=_cmd_up)
    down = sub.add_parser("down", help="stop the components recorded in the run dir and remove it")
    down.add_argument("--run-dir", default=str(DEFAULT_RUN_DIR))
    down.add_argument("--keep", action="store_true", help="keep the run dir (logs, certs)")
    down.set_defaults(func=_cmd_down)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result
