"""cgpud entry point: parse arguments, wire the parts, run."""
from __future__ import annotations

import argparse
import json
import sys

import structlog

from cgpud import __version__
from cgpud.daemon.inventory import read_inventory
from cgpud.errors import CgpuError
from cgpud.logs import configure_logging


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cgpud",
        description="cgpu node daemon: owns the GPU inventory, instance tables and compute scheduler.",
    )
    p.add_argument("--version", action="version", version=f"cgpud {__version__}")
    p.add_argument(
        "--inventory", action="store_true", help="print this node's GPU inventory as JSON and exit"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging()
    log = structlog.get_logger("cgpud")
    try:
        inventory = read_inventory()
    except CgpuError as e:
        print(f"cgpud: {e}", file=sys.stderr)
        return 1
    if args.inventory:
        print(json.dumps(inventory.as_dict(), indent=2))
        return 0
    log.info("inventory", gpus=len(inventory.gpus), driver=inventory.driver_version)
    print(
        "cgpud: serving instances is not implemented yet; use --inventory to read the GPUs",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
