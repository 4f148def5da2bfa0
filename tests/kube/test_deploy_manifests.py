"""deploy/: the RBAC and DaemonSet manifests read by the real kubectl (1.32)
with no cluster. `kubectl apply --dry-run=client` needs the API server's
discovery even with --validate=false, so the manifests go through kubectl's
--local mode instead: `label --local` decodes every object and kind, and
`set env --local` / `set subject --local` decode the DaemonSet and the
binding into their typed Go structs and print them back, which drops any
field the API does not have: each field we wrote must come back."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBECTL = shutil.which("kubectl")


def kubectl(*args: str) -> Any:
    assert KUBECTL is not None, "kubectl is not installed"
    done = subprocess.run([KUBECTL, *args, "-o", "json"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "KUBECONFIG": "/dev/null"})
    assert done.returncode == 0, done.stderr
    # One JSON document per file, one after the other.
    out, text, decoder = [], done.stdout.strip(), json.JSONDecoder()
    while text:
        data, end = decoder.raw_decode(text)
        out += data["items"] if data.get("kind") == "List" else [data]
        text = text[end:].strip()
    return out


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def missing(written: Any, decoded: Any, path: str = "") -> list[str]:
    """Paths of `written` that `decoded` lacks or holds otherwise."""
    if isinstance(written, dict):
        if not isinstance(decoded, dict):
            return [path or "/"]
        return [p for k, v in written.items() for p in missing(v, decoded.get(k), f"{path}/{k}")]
    if isinstance(written, list):
        if not isinstance(decoded, list) or len(decoded) < len(written):
            return [path]
        return [p for i, v in enumerate(written) for p in missing(v, decoded[i], f"{path}/{i}")]
    return [] if written == decoded or str(written) == str(decoded) else [path]


def test_every_object_decodes_with_its_kind():
    objects = kubectl("label", "--local", "-f", str(DEPLOY), "checked=yes")
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects)
    assert kinds == [("ClusterRole", "cgpud"), ("ClusterRoleBinding", "cgpud"), ("DaemonSet", "cgpud"),
                     ("ServiceAccount", "cgpud")]


def test_the_daemonset_has_only_real_fields_and_what_cgpud_needs():
    [written] = documents("cgpud-daemonset.yaml")
    [decoded] = kubectl("set", "env", "--local", "-f", str(DEPLOY / "cgpud-daemonset.yaml"), "CHECK=1")
    assert missing(written, decoded) == []
    pod = decoded["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["serviceAccountName"] == "cgpud"
    [container] = pod["containers"]
    assert container["securityContext"]["privileged"] is True
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources", "/var/run/cdi", "/run/cgpud",
            "/var/lib/cgpud", "/dev"} <= mounted
    # Host paths at the same paths: CDI specs and Allocate mounts name them for the host.
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    assert all(host[m["name"]] == m["mountPath"] for m in container["volumeMounts"])
    [term] = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "ack.node.gpu.schedule", "operator": "Exists"}]


def test_rbac_grants_what_the_agent_calls(tmp_path):
    roles = {d["kind"]: d for d in documents("cgpud-rbac.yaml")}
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in roles["ClusterRole"]["rules"]}
    assert rules[(("",), ("pods",))] >= {"get", "list", "patch"}
    assert rules[(("",), ("nodes",))] >= {"get", "patch"}
    alone = tmp_path / "binding.yaml"
    alone.write_text(yaml.safe_dump(roles["ClusterRoleBinding"]))
    [binding] = kubectl("set", "subject", "--local", "-f", str(alone), "--serviceaccount=kube-system:check")
    assert missing(roles["ClusterRoleBinding"], binding) == []
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cgpud"}
    assert {"kind": "ServiceAccount", "name": "cgpud", "namespace": "kube-system"} in binding["subjects"]


def test_a_misspelt_field_is_caught(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((DEPLOY / "cgpud-daemonset.yaml").read_text().replace("hostPID: true", "hostPid: true"))
    [written] = [d for d in yaml.safe_load_all(bad.read_text()) if d]
    [decoded] = kubectl("set", "env", "--local", "-f", str(bad), "CHECK=1")
    assert missing(written, decoded) == ["/spec/template/spec/hostPid"]

