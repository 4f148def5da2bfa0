"""What the NVIDIA container toolkit and a registry give a pod on a real
GPU node, added to a pod the README's user wrote (tests/realkube/test_readme_kube.py):
`python -m tests.realkube.toolkit_part TEMPLATE < pod.yaml > pod.json`.

From TEMPLATE (a RealCluster.workload_pod, JSON) each container takes the
image this cluster has instead of a registry's (the user's image names one
the machine cannot pull), and the simulated driver's state by a hostPath
and two variables; the pod takes the template's volumes and network. What
the user wrote (names, command, resources) is kept as written."""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml


def with_toolkit_part(pod: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    given = template["spec"]["containers"][0]
    for c in pod["spec"]["containers"]:
        c["image"], c["imagePullPolicy"] = given["image"], given["imagePullPolicy"]
        c["env"] = [*c.get("env", []), *given["env"]]
        c["volumeMounts"] = [*c.get("volumeMounts", []), *given["volumeMounts"]]
    pod["spec"]["volumes"] = [*pod["spec"].get("volumes", []), *template["spec"]["volumes"]]
    pod["spec"]["hostNetwork"] = template["spec"]["hostNetwork"]
    return pod


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        template = json.load(f)
    pods = [with_toolkit_part(doc, template) for doc in yaml.safe_load_all(sys.stdin) if doc]
    json.dump({"apiVersion": "v1", "kind": "List", "items": pods}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
