"""cgpuctl: the operator's command line. Each verb parses its arguments and
calls one function; errors print one line and exit non-zero."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from cgpud import __version__
from cgpud.cli import simulator
from cgpud.errors import CgpuError

Handler = Callable[[argparse.Namespace], int]


def _machine(args: argparse.Namespace) -> simulator.SimMachine:
    return simulator.SimMachine(
        gpus=args.gpus, memory=simulator.parse_size(args.mem), name=args.name, sms=args.sms, nvlink=args.nvlink
    )


def _sim_env(args: argparse.Namespace) -> int:
    files = simulator.write_config(_machine(args))
    sys.stdout.write(simulator.env_exports(files))
    return 0


def _sim_reset(args: argparse.Namespace) -> int:
    if args.state:
        state = Path(args.state)
    elif os.environ.get("CGPU_SIM_STATE"):
        state = Path(os.environ["CGPU_SIM_STATE"])
    else:
        state = simulator.files_for(_machine(args)).state
    removed = simulator.reset(state)
    print(f"{'cleared' if removed else 'already clear:'} {state}")
    return 0


def _sim_demo(args: argparse.Namespace) -> int:
    from cgpud.cli import simdemo

    return simdemo.run(_machine(args), seconds=args.seconds)


def _add_machine_options(p: argparse.ArgumentParser) -> None:
    d = simulator.SimMachine()
    p.add_argument("--gpus", type=int, default=d.gpus, help=f"number of GPUs (default {d.gpus})")
    p.add_argument("--mem", default="80GiB", help="memory per GPU, e.g. 16GiB (default 80GiB)")
    p.add_argument("--name", default=d.name, help=f"GPU model name (default {d.name!r})")
    p.add_argument("--sms", type=int, default=d.sms, help=f"streaming multiprocessors per GPU (default {d.sms})")
    p.add_argument("--nvlink", action="store_true", help="connect every GPU to every other by NVLink")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cgpuctl", description="Operate cgpu, the GPU sharing runtime, on this node.")
    p.add_argument("--version", action="version", version=f"cgpuctl {__version__}")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)

    sim = verbs.add_parser("sim", help="simulated GPUs for development, tests and demos")
    sim_verbs = sim.add_subparsers(dest="sim_verb", metavar="ACTION", required=True)
    env = sim_verbs.add_parser(
        "env",
        help="print the shell exports that make programs see simulated GPUs",
        description='Use as: eval "$(cgpuctl sim env --gpus 2 --mem 16GiB)"',
    )
    _add_machine_options(env)
    env.set_defaults(handler=_sim_env)
    reset = sim_verbs.add_parser(
        "reset",
        help="clear the simulated GPUs' shared state",
        description="Clears $CGPU_SIM_STATE, or the state of the machine the options describe.",
    )
    _add_machine_options(reset)
    reset.add_argument("--state", help="state file to clear")
    reset.set_defaults(handler=_sim_reset)
    demo = sim_verbs.add_parser("demo", help="run two workloads sharing one simulated GPU and report")
    _add_machine_options(demo)
    demo.add_argument("--seconds", type=float, default=2.0, help="how long each workload runs (default 2)")
    demo.set_defaults(handler=_sim_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except CgpuError as e:
        print(f"cgpuctl: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
