"""README.md's `kube` blocks, run by bash as they stand against the real
cluster (issue 41), with the admin kubeconfig and the kubectl plugin on
PATH as a user has them. The one thing added is what the NVIDIA container
toolkit and a registry give a pod on a real GPU node: `kubectl apply -f -`
of the README's pod goes through tests/realkube/toolkit_part.py (this
cluster's image, the simulated driver's state); the pod's resources and
command are the README's. Afterwards the node's mode label is put back and
the pod deleted, for the tests that share the cluster."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from cgpud.kube.model import LABEL_MODE
from tests.harness.daemon import BIN
from tests.harness.readme import README, readme_blocks
from tests.harness.wait import until
from tests.realkube.cluster import WAIT, RealCluster

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# `kubectl apply -f -` gets the toolkit's part; every other kubectl is the real one, as typed.
KUBECTL = """kubectl() {
    if [ "$*" = "apply -f -" ]; then
        "$CGPU_PYTHON" -m tests.realkube.toolkit_part "$CGPU_POD_TEMPLATE" | command kubectl apply -f -
    else
        command kubectl "$@"
    fi
}
"""


def _readme_table() -> list[list[str]]:
    """The `kubectl inspect cgpu` output the README shows, split into words."""
    text = README.read_text()
    shown = re.search(r"```text\n(NAME .*?)```", text, re.S)
    assert shown, "the README shows no kubectl inspect cgpu output"
    return [line.split() for line in shown[1].splitlines()]


def test_the_readmes_kubernetes_blocks_run_on_the_real_cluster(
    cluster: RealCluster, tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    node = cluster.nodes[0]
    assert node.name == "node-0", "the README's blocks name node-0"
    # Where the README begins: cgpu deployed (docs/scheduler.md's steps), the node reporting.
    if node.cgpud is None:
        cluster.start_cgpud(node)
    until(
        lambda: bool(cluster.extender_view().get(node.name)), WAIT, interval=0.5, what="node-0 in the extender's view"
    )
    before = cluster.get("node", node.name)["metadata"]["labels"].get(LABEL_MODE)
    template = tmp_path / "pod-template.json"
    template.write_text(json.dumps(cluster.workload_pod("template", "true")))
    env = dict(
        os.environ,
        PATH=f"{BIN}:/usr/bin:/bin",
        KUBECONFIG=str(cluster.admin_kubeconfig),
        CGPU_PYTHON=str(BIN / "python"),
        CGPU_POD_TEMPLATE=str(template),
    )
    outputs = []
    try:
        for block in readme_blocks("kube"):
            out = subprocess.run(
                ["bash", "-e", "-c", KUBECTL + block.text],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            record_property("readme_block", block.where)
            if out.returncode != 0:
                out.stderr += cluster.describe("infer") + json.dumps(cluster.extender_view(), indent=1)[:3000]
            assert out.returncode == 0, (
                f"{block.where} failed:\n{block.text}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            )
            outputs.append(out.stdout)
        shown = [line.split() for line in outputs[-1].splitlines() if line.strip()]
        readme = _readme_table()
        # The same table as the README's: its header, then node-0's row with the pod's 4 GiB on GPU 0.
        header = next(row for row in shown if row[:1] == ["NAME"])
        assert header == readme[0], (header, readme[0])
        [row] = [row for row in shown if row[:1] == [node.name]]
        assert row[2:] == readme[1][2:], (row, readme[1])
        assert shown[-1] == readme[-1], (shown[-1], readme[-1])
    finally:
        cluster.kubectl("delete", "pod", "infer", "--ignore-not-found", "--wait=true", "--grace-period=1", timeout=120)
        value = f"{LABEL_MODE}={before}" if before else f"{LABEL_MODE}-"
        cluster.kubectl("label", "node", node.name, value, "--overwrite")
