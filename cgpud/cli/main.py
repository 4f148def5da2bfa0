"""cgpuctl: the operator's command line. Each verb parses its arguments and
calls one function; errors print one line and exit non-zero."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cgpud
from cgpud.cli.sim_topology import TOPOLOGIES
from cgpud.cli import simulator
from cgpud.node.model import ComputePolicy, Owner, OwnerKind, Request
from cgpud.errors import UsageError
from cgpud.logs import run_command
from cgpud.units import format_memory, parse_memory

if TYPE_CHECKING:
    from cgpud.cli.client import LocalClient

Handler = Callable[[argparse.Namespace], int]


def _machine(args: argparse.Namespace) -> simulator.SimMachine:
    if args.topology and args.nvlink:
        raise UsageError("--nvlink and --topology both say which GPUs are linked: give one")
    gpus = args.gpus
    if gpus is None:
        gpus = len(TOPOLOGIES[args.topology]) if args.topology else simulator.SimMachine.gpus
    return simulator.SimMachine(
        gpus=gpus,
        memory=parse_memory(args.mem),
        name=args.name,
        sms=args.sms,
        nvlink=args.nvlink,
        topology=args.topology or "",
        mig=args.mig or "",
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


def _sim_fault(args: argparse.Namespace) -> int:
    fault = simulator.Fault(gpu=args.gpu, xid=args.xid, lost=args.lost, recover=args.recover)
    fault.sim_stat_args()  # a bad fault is refused before any file is written
    if os.environ.get("CGPU_SIM_CONFIG") and os.environ.get("CGPU_SIM_STATE"):
        files = simulator.SimFiles(Path(os.environ["CGPU_SIM_CONFIG"]), Path(os.environ["CGPU_SIM_STATE"]))
    else:
        files = simulator.write_config(_machine(args))
    state = simulator.inject_fault(files, fault)
    print(f"gpu {state['index']}: {'lost' if state['lost'] else 'on the bus'}, {state['xids']} XIDs reported")
    return 0


def _sim_demo(args: argparse.Namespace) -> int:
    from cgpud.cli import simdemo

    return simdemo.run(_machine(args), seconds=args.seconds)


def _socket(args: argparse.Namespace) -> Path:
    if args.socket:
        return Path(args.socket)
    from cgpud import config as settings  # a third of cgpuctl's imports: only without --socket

    return settings.load(None, {}).socket


# How long cgpuctl waits for a cgpud that is down or restarting: as long as
# the relays (a tenant started during a restart starts after it), shorter for
# commands that only read.
READ_WAIT = 3.0


def _wait(args: argparse.Namespace, reads: bool = False) -> float:
    from cgpud.contract import RELAY_WAIT_S

    if args.wait is not None:
        return args.wait
    return READ_WAIT if reads else float(RELAY_WAIT_S)


def _say(message: str) -> None:
    print(f"cgpuctl: {message}", file=sys.stderr, flush=True)


def _client(args: argparse.Namespace, reads: bool = False) -> LocalClient:
    from cgpud.cli.client import LocalClient

    return LocalClient(_socket(args), wait=_wait(args, reads), notice=_say)


def _bounded(convert: Callable[[str], float], low: int, high: int, what: str, unit: str) -> Callable[[str], Any]:
    """An argparse type: `convert`ed, and between low and high."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {low} to {high} {unit}")
        return value

    return parse


_seconds = _bounded(float, 0, 3600, "a number of seconds", "seconds")


def _inspect(args: argparse.Namespace) -> int:
    from cgpud.cli import inspect

    if isinstance(args.details, str):
        return _inspect_instance(args, args.details)
    with _client(args, reads=True) as client:
        info, counted = client.node_info(), client.list_with_violations()
    instances = [i for i, _ in counted]
    if args.output == "json":
        print(json.dumps(inspect.as_json(info, instances, {i.id: n for i, n in counted}), indent=2))
    else:
        sys.stdout.write(inspect.inspect_details(info, instances) if args.details else inspect.inspect_summary(info))
    return 0


def _inspect_instance(args: argparse.Namespace, instance_id: str) -> int:
    from cgpud.cli import inspect

    with _client(args, reads=True) as client:
        instance, violations = client.get_with_violations(instance_id)
        listing = client.bypass_events(instance_id, args.limit)
    if args.output == "json":
        [out] = inspect.as_json_instances([instance], {instance.id: violations})
        print(json.dumps(out | inspect.as_json_events(listing), indent=2))
    else:
        sys.stdout.write(inspect.instance_details(instance, violations, listing))
    return 0


def _list(args: argparse.Namespace) -> int:
    from cgpud.cli import inspect

    with _client(args, reads=True) as client:
        counted = client.list_with_violations(include_released=args.all)
    instances, violations = [i for i, _ in counted], {i.id: n for i, n in counted}
    if args.output == "json":
        print(json.dumps(inspect.as_json_instances(instances, violations), indent=2))
    else:
        sys.stdout.write(inspect.instance_list(instances, violations))
    return 0


def _events(args: argparse.Namespace) -> int:
    from cgpud.cli import inspect

    with _client(args, reads=True) as client:
        listing = client.bypass_events(args.instance, args.limit)
    if args.output == "json":
        print(json.dumps(inspect.as_json_events(listing), indent=2))
    else:
        sys.stdout.write(inspect.events_text(listing))
    return 0


_limit = _bounded(int, 1, 1000, "a whole number", "events")


def _request(args: argparse.Namespace, owner: Owner) -> Request:
    """The instance _add_request_options asks for."""
    return Request(owner, parse_memory(args.mem), args.gpus, args.core, args.weight, int(args.high_priority))


def _run(args: argparse.Namespace) -> int:
    from cgpud.cli import run

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return run.run(_socket(args), _request(args, run.owner()), command, wait=_wait(args), notice=_say)


def _create(args: argparse.Namespace) -> int:
    from cgpud.cli import inspect

    # A random default name: each plain `create` is a new device. A given
    # --name makes create idempotent (the same name gets the same instance).
    name = args.name or f"cgpuctl-{socket.gethostname()}-{os.urandom(3).hex()}"
    with _client(args) as client:
        instance = client.create(_request(args, Owner(OwnerKind.DEVICE, name)))
    if args.output == "json":
        print(json.dumps(inspect.as_json_instances([instance])[0], indent=2))
    else:
        print(instance.id)
    return 0


def _release(args: argparse.Namespace) -> int:
    with _client(args) as client:
        instance = client.release(args.id)
    print(f"released {instance.id}")
    return 0


def _resize(args: argparse.Namespace) -> int:
    if args.mem is None and args.core is None:
        raise UsageError("nothing to resize: give --mem, --core or both")
    memory = None if args.mem is None else parse_memory(args.mem)
    with _client(args) as client:
        instance = client.resize(args.id, memory, args.core)
    grant = instance.grants[0]
    core = f", {grant.core_percent}% compute" if grant.core_percent else ""
    print(f"resized {instance.id}: {format_memory(grant.memory)} per GPU{core}")
    return 0


def _cdi_generate(args: argparse.Namespace) -> int:
    from cgpud.containers import cdi

    target = cdi.check_output(Path(args.output)) if args.output else None
    with _client(args) as client:
        text = client.cdi_spec()
    if target is None:
        sys.stdout.write(text)
    else:
        cdi.write_spec(text, target)
        print(f"wrote {target}")
    return 0


def _policy(args: argparse.Namespace) -> int:
    wanted = _compute_policy(args.value) if args.policy_verb == "set" else None
    with _client(args, reads=wanted is None) as client:
        policy = client.set_compute_policy(wanted, args.gpu) if wanted is not None else client.policy()
    print(
        f"mode={policy.mode.value} placement={policy.placement.value} "
        f"compute_policy={int(policy.compute_policy)} ({policy.compute_policy.name.lower()}) "
        f"max_instances_per_gpu={policy.max_instances_per_gpu} core_step={policy.core_step}"
    )
    for gpu, p in policy.gpu_compute_policies:
        print(f"gpu {gpu}: compute_policy={int(p)} ({p.name.lower()})")
    return 0


def _compute_policy(text: str) -> ComputePolicy:
    names = {p.name.lower(): p for p in ComputePolicy}
    if text.isdigit() and int(text) in ComputePolicy._value2member_map_:
        return ComputePolicy(int(text))
    if text.lower() in names:
        return names[text.lower()]
    choices = ", ".join(f"{int(p)} {p.name.lower()}" for p in ComputePolicy)
    raise UsageError(f"unknown compute policy {text!r}: use one of {choices}")


def _doctor(args: argparse.Namespace) -> int:
    from cgpud import config as settings
    from cgpud.cli import doctor

    config = settings.load(Path(args.config) if args.config else None, {})
    docker_config = Path(args.docker_config) if args.docker_config else None
    text, code = doctor.report(doctor.diagnose(config, _socket(args), docker_config))
    sys.stdout.write(text)
    return code


def _runtime_configure(args: argparse.Namespace) -> int:
    from cgpud.cli import runtime_configure

    sys.stdout.write(
        runtime_configure.configure_from_cli(
            args.engine,
            config=args.config,
            runtime_path=args.runtime_path,
            name=args.name,
            set_as_default=args.set_as_default,
            dry_run=args.dry_run,
        )
    )
    return 0


def _add_machine_options(p: argparse.ArgumentParser) -> None:
    d = simulator.SimMachine()
    p.add_argument("--gpus", type=int, default=None, help=f"number of GPUs (default {d.gpus}, or the --topology's)")
    p.add_argument(
        "--mem",
        default="80GiB",
        help="memory per GPU: 16 (GiB, like aliyun.com/gpu-mem), 16GiB, 512MiB (default 80GiB)",
    )
    p.add_argument("--name", default=d.name, help=f"GPU model name (default {d.name!r})")
    p.add_argument("--sms", type=int, default=d.sms, help=f"streaming multiprocessors per GPU (default {d.sms})")
    p.add_argument("--nvlink", action="store_true", help="connect every GPU to every other by NVLink")
    p.add_argument(
        "--topology",
        choices=sorted(TOPOLOGIES),
        help="a machine's PCIe tree and NVLinks: dgx1 or hgx8 (8 GPUs), pcie4 or nvlink2x2 (4); docs/simulated-gpu.md",
    )
    p.add_argument(
        "--mig",
        help="boot every GPU in MIG mode with these GPU instances, in order: 3g.40gb,2g.20gb,1g.10gb "
        "('on': MIG mode, no instance); H100 80GB profiles, docs/simulated-gpu.md",
    )


def _add_request_options(p: argparse.ArgumentParser) -> None:
    """What an instance asks for, as run and create take it."""
    p.add_argument("--mem", required=True, help="memory per GPU: 4 (GiB, like aliyun.com/gpu-mem), 4GiB, 512MiB")
    p.add_argument("--gpus", type=int, default=1, help="number of GPUs (default 1)")
    p.add_argument("--core", type=int, default=0, help="compute share in percent (core_mem and mps nodes)")
    p.add_argument("--weight", type=int, default=1, help="scheduling weight under the weighted policy (default 1)")
    p.add_argument("--high-priority", action="store_true", help="schedule ahead of normal instances")


class _PrintVersion(argparse.Action):
    """argparse's "version" action, with the version read only when asked for (cgpud.__version__)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        sys.stdout.write(f"cgpuctl {cgpud.__version__}\n")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cgpuctl", description="Operate cgpu, the GPU sharing runtime, on this node.")
    p.add_argument("--version", action=_PrintVersion, nargs=0, help="show the version and exit")
    p.add_argument(
        "--socket", help="cgpud's local API socket (default from /etc/cgpu/config.toml, else /run/cgpud/cgpud.sock)"
    )
    p.add_argument(
        "--wait",
        type=_seconds,
        metavar="SECONDS",
        help="how long to wait for a cgpud that is down or restarting, saying so once "
        "(default 10; 3 for list, inspect, events and policy show; 0 fails at once)",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)

    inspect = verbs.add_parser("inspect", help="GPU memory allocated on this node, as kubectl inspect cgpu shows it")
    inspect.add_argument(
        "-d",
        "--details",
        nargs="?",
        const=True,
        default=False,
        metavar="ID",
        help="list every instance; with an instance id, that instance and its recent bypass events",
    )
    inspect.add_argument(
        "--limit", type=_limit, default=20, metavar="N", help="with -d ID: show its newest N bypass events (default 20)"
    )
    inspect.add_argument("--output", choices=["table", "json"], default="table")
    inspect.set_defaults(handler=_inspect)

    lst = verbs.add_parser("list", help="instances on this node")
    lst.add_argument("--all", action="store_true", help="include released instances")
    lst.add_argument("--output", choices=["table", "json"], default="table")
    lst.set_defaults(handler=_list)

    events = verbs.add_parser(
        "events",
        help="what the bypass watchdog found: GPU use around libcgpu, newest last",
        description="Reports and kills of the bypass watchdog since cgpud started (the newest 1000 are kept): "
        "instances holding more GPU memory or compute than granted, and processes on a GPU that "
        "belong to no instance. Says so when the watchdog is off. See docs/bypass.md.",
    )
    events.add_argument("--instance", metavar="ID", help="only this instance's events")
    events.add_argument(
        "--limit", type=_limit, default=100, metavar="N", help="the newest N events (default 100, at most 1000)"
    )
    events.add_argument("--output", choices=["table", "json"], default="table")
    events.set_defaults(handler=_events)

    run = verbs.add_parser(
        "run",
        help="run a command under a fresh instance (memory limit, compute share)",
        description="Example: cgpuctl run --mem 4GiB --core 30 -- python train.py",
    )
    _add_request_options(run)
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    run.set_defaults(handler=_run)

    create = verbs.add_parser(
        "create",
        help="reserve an instance to hand out as a device (CDI); it lives until released or reboot",
        description="Example: cgpuctl create --mem 4GiB --name train-a. Prints the instance id; containers get it "
        "as the CDI device cgpu.io/gpu=<id> (see cgpuctl cdi generate).",
    )
    _add_request_options(create)
    create.add_argument(
        "--name", help="device name; the same name gets the same instance back (default cgpuctl-<hostname>-<random>)"
    )
    create.add_argument(
        "--output", choices=["text", "json"], default="text", help="text: the instance id; json: the instance"
    )
    create.set_defaults(handler=_create)

    release = verbs.add_parser("release", help="release an instance (its GPU memory and compute share)")
    release.add_argument("id", help="instance id, as cgpuctl create or cgpuctl list shows it")
    release.set_defaults(handler=_release)

    resize = verbs.add_parser(
        "resize",
        help="change a running instance's memory or compute share in place",
        description="Its processes see the new memory limit at their next allocation (cuMemGetInfo shows it) "
        "and the scheduler the new share at once. A shrink below what they hold now is refused.",
    )
    resize.add_argument("id", help="instance id, as cgpuctl list shows it")
    resize.add_argument("--mem", help="memory per GPU: 4 (GiB), 4GiB, 512MiB")
    resize.add_argument("--core", type=int, help="compute share in percent (core_mem nodes; 0: none)")
    resize.set_defaults(handler=_resize)

    cdi = verbs.add_parser("cdi", help="Container Device Interface spec for reserved instances")
    cdi_verbs = cdi.add_subparsers(dest="cdi_verb", metavar="ACTION", required=True)
    generate = cdi_verbs.add_parser(
        "generate",
        help="print or write the CDI spec of the instances made by cgpuctl create",
        description="Each instance reserved with cgpuctl create becomes the CDI device cgpu.io/gpu=<instance id>, "
        "e.g. podman run --device cgpu.io/gpu=cgpu-0123456789ab ... Runtimes read specs from /etc/cdi "
        "(static) and /var/run/cdi (dynamic): cgpuctl cdi generate --output /var/run/cdi/cgpu.json. "
        "Generate again after each create or release.",
    )
    generate.add_argument(
        "--output", metavar="PATH", help="write the spec to this file (atomically, mode 0644) instead of printing it"
    )
    generate.set_defaults(handler=_cdi_generate)

    policy = verbs.add_parser("policy", help="show or change the compute policy")
    policy_verbs = policy.add_subparsers(dest="policy_verb", metavar="ACTION", required=True)
    policy_verbs.add_parser("get", help="show the node's policy").set_defaults(handler=_policy)
    setp = policy_verbs.add_parser(
        "set",
        help="set the compute policy: 0 fair, 1 preemptive, 2 weighted, 3 fixed, 4 soft, 5 native (number or name)",
    )
    setp.add_argument("value")
    setp.add_argument(
        "--gpu",
        type=int,
        help="this GPU only (index as nvidia-smi shows it); without it the whole node, replacing every per-GPU policy",
    )
    setp.set_defaults(handler=_policy)

    doctor = verbs.add_parser("doctor", help="check driver, daemon, state directory, library and runtime")
    doctor.add_argument("--config", help="cgpud settings file to check against")
    doctor.add_argument(
        "--docker-config",
        help="the daemon.json to check (default: the one each running dockerd reads, or /etc/docker/daemon.json)",
    )
    doctor.set_defaults(handler=_doctor)

    runtime = verbs.add_parser("runtime", help="register cgpu's runtime with containerd or Docker")
    runtime_verbs = runtime.add_subparsers(dest="runtime_verb", metavar="ACTION", required=True)
    configure = runtime_verbs.add_parser(
        "configure",
        help="add the cgpu runtime to containerd's or Docker's config, keeping the rest",
        description="Example: cgpuctl runtime configure --containerd --dry-run. containerd gets a drop-in "
        "<config dir>/conf.d/cgpu.toml imported from its config; Docker gets daemon.json runtimes.",
    )
    engine = configure.add_mutually_exclusive_group(required=True)
    engine.add_argument(
        "--containerd",
        dest="engine",
        action="store_const",
        const="containerd",
        help="configure containerd (/etc/containerd/config.toml)",
    )
    engine.add_argument(
        "--docker",
        dest="engine",
        action="store_const",
        const="docker",
        help="configure Docker (/etc/docker/daemon.json)",
    )
    engine.add_argument(
        "--nvidia-toolkit",
        dest="engine",
        action="store_const",
        const="nvidia-toolkit",
        help="make the NVIDIA container toolkit give GPUs only from device lists (what cgpud's "
        "Allocate names), never from a container's NVIDIA_VISIBLE_DEVICES "
        "(/etc/nvidia-container-runtime/config.toml)",
    )
    configure.add_argument("--set-as-default", action="store_true", help="make it the default runtime")
    configure.add_argument("--dry-run", action="store_true", help="print the changes as a diff, write nothing")
    configure.add_argument("--config", help="the engine's config file, if not the default")
    configure.add_argument("--runtime-path", help="absolute path of cgpu-runtime (default: the installed one)")
    configure.add_argument("--name", default="cgpu", help="runtime name (default cgpu)")
    configure.set_defaults(handler=_runtime_configure)

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
    fault = sim_verbs.add_parser(
        "fault",
        help="inject a GPU fault: an XID, the GPU falling off the bus, or a reset",
        description="Acts on the machine of $CGPU_SIM_CONFIG and $CGPU_SIM_STATE, else on the one the options "
        "describe. Example: cgpuctl sim fault --gpu 1 --xid 48; cgpuctl sim fault --gpu 1 --lost; "
        "cgpuctl sim fault --gpu 1 --recover",
    )
    _add_machine_options(fault)
    fault.add_argument("--gpu", type=int, required=True, help="GPU index, as nvidia-smi shows it")
    kind = fault.add_mutually_exclusive_group(required=True)
    kind.add_argument("--xid", type=int, help="report this XID (1-999) as an NVML event")
    kind.add_argument(
        "--lost", action="store_true", help="the GPU falls off the bus: XID 79, then NVML answers GPU_IS_LOST"
    )
    kind.add_argument("--recover", action="store_true", help="bring a lost GPU back, as a reset does")
    fault.set_defaults(handler=_sim_fault)
    demo = sim_verbs.add_parser("demo", help="run two workloads sharing one simulated GPU and report")
    _add_machine_options(demo)
    demo.add_argument("--seconds", type=float, default=2.0, help="how long each workload runs (default 2)")
    demo.set_defaults(handler=_sim_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    return run_command("cgpuctl", lambda: handler(args))


if __name__ == "__main__":
    sys.exit(main())
