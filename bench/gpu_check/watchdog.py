"""stub"""

from bench.gpu_check.rig import Rig
from bench.gpu_check.runner import Runner


def run(rig: Rig, runner: Runner) -> None:
    pass
