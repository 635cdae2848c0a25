"""``bridge-cluster up [--nodes N] | down | status``: a real Slurm cluster on this machine.

Exit status: 0 on success, 1 when a daemon or the package installation failed, 2 for bad input
(a bad ``--nodes``, a foreign /etc/slurm/slurm.conf, not root). Errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import List, Optional

from bridge_hpc.contracts.errors import EXIT_BAD_INPUT, ConfigError
from bridge_hpc.local_slurm.cluster import DEFAULT_STATE_DIR, ClusterError, LocalCluster

EXIT_FAILED = 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    state_help = f"state directory (default: $BRIDGE_CLUSTER_DIR or {DEFAULT_STATE_DIR})"
    parser = argparse.ArgumentParser(
        prog="bridge-cluster",
        description="Run a real Slurm cluster (slurmctld, slurmd per node, slurmdbd + MariaDB, munge) "
        "on this machine, for tests, demos and a first run.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{up,down,status}")
    sub.required = True
    up = sub.add_parser("up", help="start the cluster (or reconfigure it to N nodes) and wait until idle")
    up.add_argument("--nodes", type=_positive_int, default=1,
                    help="number of nodes: 1 = one node named after this host, N > 1 = nodes n1..nN")
    up.add_argument("--state-dir", default=None, help=state_help)
    up.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for idle nodes (default 90)")
    down = sub.add_parser("down", help="stop the daemons that `up` started (by their pid files)")
    down.add_argument("--state-dir", default=None, help=state_help)
    status = sub.add_parser("status", help="show our daemons (pid, alive) and sinfo")
    status.add_argument("--state-dir", default=None, help=state_help)
    return parser


def _print_status(cluster: LocalCluster) -> int:
    st = cluster.status()
    rows = [(name, str(d["pid"] or "-"), "yes" if d["alive"] else "no") for name, d in st["daemons"].items()]
    width = max(len("daemon"), *(len(r[0]) for r in rows))
    print(f"state dir: {st['state_dir']}   configured nodes: {st['configured_nodes'] or '-'}   "
          f"up: {'yes' if st['up'] else 'no'}")
    print(f"{'daemon':<{width}}  {'pid':>7}  alive")
    for name, pid, alive in rows:
        print(f"{name:<{width}}  {pid:>7}  {alive}")
    print()
    if st["daemons"].get("slurmctld", {}).get("alive"):
        out = subprocess.run(["sinfo"], capture_output=True, text=True, timeout=30)
        sys.stdout.write(out.stdout or out.stderr)
    else:
        print("sinfo: slurmctld is not running (bridge-cluster up starts it)")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage message
        return EXIT_BAD_INPUT if exc.code else 0
    cluster = LocalCluster(args.state_dir)
    try:
        if args.command == "up":
            cluster.up(nodes=args.nodes, timeout=args.timeout)
        elif args.command == "down":
            cluster.down()
        else:
            return _print_status(cluster)
    except ConfigError as err:
        print(f"bridge-cluster: error: {err.format()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ClusterError as err:
        print(f"bridge-cluster: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("bridge-cluster: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
