"""cgpud entry point: parse settings, start the daemon, run until told to stop."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from cgpud import __version__
from cgpud import config as settings
from cgpud.daemon.daemon import Daemon
from cgpud.logs import configure_logging, run_command
from cgpud.node.inventory import read_inventory


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cgpud", description="cgpu node daemon: GPU inventory, instance tables, local API."
    )
    p.add_argument("--version", action="version", version=f"cgpud {__version__}")
    p.add_argument("--inventory", action="store_true", help="print this node's GPU inventory as JSON and exit")
    settings.add_arguments(p)
    return p


def run(config: settings.DaemonConfig) -> int:
    daemon = Daemon(config)
    daemon.start()
    try:
        daemon.wait()
    finally:
        daemon.stop()
    return 0


def _inventory_or_run(args: argparse.Namespace) -> int:
    if args.inventory:
        print(json.dumps(read_inventory().as_dict(), indent=2))
        return 0
    return run(settings.from_arguments(args))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging()
    return run_command("cgpud", lambda: _inventory_or_run(args))


if __name__ == "__main__":
    sys.exit(main())
