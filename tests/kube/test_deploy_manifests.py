"""deploy/: the RBAC and DaemonSet manifests read by the real kubectl (1.32)
with no cluster. `kubectl apply --dry-run=client` needs the API server's
discovery even with --validate=false, so the manifests go through kubectl's
--local mode instead: `label --local` decodes every object and kind, and
`set env --local` / `set subject --local` decode the DaemonSet and the
binding into their typed Go structs and print them back, which drops any
field the API does not have: each field we wrote must come back."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBECTL = shutil.which("kubectl")


def kubectl(*args: str) -> Any:
    assert KUBECTL is not None, "kubectl is not installed"
    done = subprocess.run(
        [KUBECTL, *args, "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "KUBECONFIG": "/dev/null"},
    )
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


# kube-scheduler's own configuration file, not an API object: checked below.
SCHEDULER_CONFIG = "kube-scheduler-config.yaml"


def test_every_object_decodes_with_its_kind():
    files = [a for p in sorted(DEPLOY.glob("*.yaml")) if p.name != SCHEDULER_CONFIG for a in ("-f", str(p))]
    objects = kubectl("label", "--local", *files, "checked=yes")
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects)
    assert kinds == [
        ("ClusterRole", "cgpu-scheduler"),
        ("ClusterRole", "cgpud"),
        ("ClusterRoleBinding", "cgpu-scheduler"),
        ("ClusterRoleBinding", "cgpud"),
        ("DaemonSet", "cgpud"),
        ("Deployment", "cgpu-scheduler"),
        ("NetworkPolicy", "cgpu-scheduler"),
        ("Service", "cgpu-scheduler"),
        ("ServiceAccount", "cgpu-scheduler"),
        ("ServiceAccount", "cgpud"),
        ("ValidatingAdmissionPolicy", "cgpud-own-node"),
        ("ValidatingAdmissionPolicyBinding", "cgpud-own-node"),
    ]


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
    assert {
        "/var/lib/kubelet/device-plugins",
        "/var/lib/kubelet/pod-resources",
        "/var/run/cdi",
        "/run/cgpud",
        "/var/lib/cgpud",
        "/dev",
    } <= mounted
    # Host paths at the same paths: CDI specs and Allocate mounts name them for the host.
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert all(
        host[m["name"]] == m["mountPath"]
        for m in container["volumeMounts"]
        if m["name"] in host and m["name"] != "capacity-tls"
    )
    # The Capacity API: the node's own TLS files from the host (a certificate
    # naming its Node: no Secret shared by every node), its own address on the Node.
    assert pod["hostNetwork"] is True and env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    args = container["command"]
    flags = dict(zip(args[3::2], args[4::2]))
    assert flags["--capacity-listen"] == "0.0.0.0:9455" and flags["--capacity-advertise"] == "$(HOST_IP):9455"
    assert not [v for v in pod["volumes"] if "secret" in v]
    tls_dir = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["capacity-tls"]
    assert host["capacity-tls"] == "/etc/cgpu/capacity-tls"
    assert all(flags[f"--capacity-tls-{k}"].startswith(tls_dir + "/") for k in ("cert", "key", "ca"))
    assert container["resources"]["limits"]["memory"] == "512Mi"
    from cgpud.daemon.main import _parser

    _parser().parse_args(args[1:])  # every flag is cgpud's
    [term] = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "ack.node.gpu.schedule", "operator": "Exists"}]


def test_rbac_grants_what_the_agent_calls(tmp_path):
    roles = {d["kind"]: d for d in documents("cgpud-rbac.yaml")}
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in roles["ClusterRole"]["rules"]}
    # exactly what cgpud/kube/apiserver.py calls, nothing more (no watch, no delete, no other resource)
    assert rules == {
        (("",), ("pods",)): {"get", "list", "patch"},
        (("",), ("nodes",)): {"get", "patch"},
        (("",), ("events",)): {"create"},
    }
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


# ---- the cluster side: cgpu-scheduler and kube-scheduler's configuration -------------------

# k8s.io/kube-scheduler/config/v1 (types.go): the JSON names of Extender and
# ExtenderManagedResource. kube-scheduler decodes its --config strictly, so
# a field not among these stops it from starting.
EXTENDER_FIELDS = {
    "urlPrefix",
    "filterVerb",
    "preemptVerb",
    "prioritizeVerb",
    "weight",
    "bindVerb",
    "enableHTTPS",
    "tlsConfig",
    "httpTimeout",
    "nodeCacheCapable",
    "managedResources",
    "ignorable",
}
MANAGED_RESOURCE_FIELDS = {"name", "ignoredByScheduler"}
SCHEDULER_CONFIG_FIELDS = {
    "apiVersion",
    "kind",
    "parallelism",
    "leaderElection",
    "clientConnection",
    "healthzBindAddress",
    "metricsBindAddress",
    "enableProfiling",
    "enableContentionProfiling",
    "percentageOfNodesToScore",
    "podInitialBackoffSeconds",
    "podMaxBackoffSeconds",
    "profiles",
    "extenders",
    "delayCacheUntilActive",
}


def scheduler_objects() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in documents("cgpu-scheduler.yaml")}


def alone(tmp_path: Path, obj: dict[str, Any]) -> Path:
    path = tmp_path / f"{obj['kind']}.yaml"
    path.write_text(yaml.safe_dump(obj))
    return path


def test_the_scheduler_config_names_real_fields_and_our_resources():
    [config] = documents(SCHEDULER_CONFIG)
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert set(config) <= SCHEDULER_CONFIG_FIELDS
    extender, whole = config["extenders"]
    assert set(extender) <= EXTENDER_FIELDS, set(extender) - EXTENDER_FIELDS
    # The second entry: the same extender for whole GPUs on topology nodes,
    # filter and prioritize only (kube-scheduler binds; it counts them too).
    assert set(whole) <= EXTENDER_FIELDS and "bindVerb" not in whole
    assert {k: whole[k] for k in ("urlPrefix", "tlsConfig", "enableHTTPS")} == {
        k: extender[k] for k in ("urlPrefix", "tlsConfig", "enableHTTPS")
    }
    assert whole["ignorable"] is True  # a preference: pods still schedule, by count, without it
    assert whole["managedResources"] == [{"name": "aliyun.com/gpu", "ignoredByScheduler": False}]
    assert extender["nodeCacheCapable"] is True and extender["enableHTTPS"] is True
    # kube-scheduler's client certificate: cgpu-scheduler binds only for it
    assert set(extender["tlsConfig"]) == {"certFile", "keyFile", "caFile"}
    assert extender["ignorable"] is False  # pods asking for shares wait rather than being placed blind
    assert isinstance(extender["weight"], int) and extender["weight"] > 0
    assert re.fullmatch(r"\d+(ms|s|m)", extender["httpTimeout"])  # a metav1.Duration
    resources = extender["managedResources"]
    assert all(set(r) <= MANAGED_RESOURCE_FIELDS for r in resources)
    assert {r["name"]: r["ignoredByScheduler"] for r in resources} == {
        "aliyun.com/gpu-mem": True,
        "aliyun.com/gpu-core.percentage": True,
        "aliyun.com/gpu-count": True,
    }
    # The urlPrefix reaches the Service on its https port.
    service = scheduler_objects()["Service"]
    url = urlsplit(extender["urlPrefix"])
    assert url.scheme == "https" and url.path in ("", "/")
    assert url.hostname.split(".")[:2] == [service["metadata"]["name"], service["metadata"]["namespace"]]
    assert url.port == next(p["port"] for p in service["spec"]["ports"] if p["name"] == "https")


def test_the_configs_verbs_are_the_ones_the_extender_answers():
    from cgpud.extender.server import ExtenderServer
    from cgpud.extender.state import ClusterState

    [config] = documents(SCHEDULER_CONFIG)
    extender, _ = config["extenders"]
    pod = {
        "metadata": {"name": "p", "namespace": "default", "uid": "u1"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": "2"}}}]},
    }
    bodies = {
        "filterVerb": {"Pod": pod, "NodeNames": ["n1"]},
        "prioritizeVerb": {"Pod": pod, "NodeNames": ["n1"]},
        "bindVerb": {"PodName": "p", "PodNamespace": "default", "PodUID": "u1", "Node": "n1"},
    }
    server = ExtenderServer(ClusterState(), None).start()
    try:
        for verb, body in bodies.items():
            request = urllib.request.Request(
                f"{server.url}/{extender[verb]}",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=10) as answer:
                assert answer.status == 200, verb
                reply = json.loads(answer.read())
            if verb == "filterVerb":
                assert "n1" in reply["FailedAndUnresolvableNodes"]  # an unknown node, with its reason
            elif verb == "prioritizeVerb":
                assert reply == [{"Host": "n1", "Score": 0}]
            else:
                assert reply["Error"]  # this one has no binder: it says so
    finally:
        server.stop()


def test_the_deployment_runs_the_extender_where_the_service_and_config_say(tmp_path):
    objects = scheduler_objects()
    written = objects["Deployment"]
    [decoded] = kubectl("set", "env", "--local", "-f", str(alone(tmp_path, written)), "CHECK=1")
    assert missing(written, decoded) == []
    pod = decoded["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "cgpu-scheduler"
    assert pod["securityContext"]["runAsNonRoot"] is True and not pod.get("hostNetwork")
    [container] = pod["containers"]
    command = container["command"]
    assert command[0] == "cgpu-scheduler"
    flags = dict(zip(command[1::2], command[2::2]))
    host, port = flags["--listen"].rsplit(":", 1)
    assert host == "0.0.0.0"  # the Service reaches the pod on its own address
    [https] = [p for p in container["ports"] if p["name"] == "https"]
    assert https["containerPort"] == int(port)
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}
    assert container["resources"]["limits"]["memory"] == "1Gi"
    # The Capacity client certificate and the serving certificate with the
    # client CA come from their Secrets' mounts, readable by nobody else.
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert all(m["readOnly"] is True for m in mounts.values())
    secrets = {v["name"]: v["secret"] for v in pod["volumes"]}
    for flags_of, volume in (
        (("--tls-cert", "--tls-key", "--tls-ca"), "capacity-client"),
        (("--serve-cert", "--serve-key", "--client-ca"), "serving"),
    ):
        for flag in flags_of:
            assert Path(flags[flag]).parent == Path(mounts[volume]["mountPath"]), flag
        assert secrets[volume]["defaultMode"] & 0o007 == 0  # not world-readable
    assert secrets["capacity-client"]["secretName"] == "cgpu-capacity-client"
    assert secrets["serving"]["secretName"] == "cgpu-scheduler-serving"
    from cgpud.extender.main import _parser

    _parser().parse_args(command[1:])  # every flag is cgpu-scheduler's
    # Only the control plane's addresses reach the port.
    policy = objects["NetworkPolicy"]
    [decoded_policy] = kubectl("label", "--local", "-f", str(alone(tmp_path, policy)), "checked=yes")
    assert missing(policy, decoded_policy) == []
    assert (
        policy["spec"]["podSelector"]["matchLabels"].items()
        <= decoded["spec"]["template"]["metadata"]["labels"].items()
    )
    [rule] = policy["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [int(port)] and [list(f) for f in rule["from"]] == [["ipBlock"]]

    service = objects["Service"]
    selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
    [decoded_service] = kubectl("set", "selector", "--local", "-f", str(alone(tmp_path, service)), selector)
    assert missing(service, decoded_service) == []
    assert service["spec"]["selector"].items() <= decoded["spec"]["template"]["metadata"]["labels"].items()
    assert [p["targetPort"] for p in service["spec"]["ports"] if p["name"] == "https"] == ["https"]


VERBS = {"GET": "get", "PATCH": "patch", "POST": "create", "PUT": "update", "DELETE": "delete"}


def rest_permission(method: str, path: str) -> tuple[str, str]:
    """(resource, verb) RBAC checks for a core API request, e.g. POST
    /api/v1/namespaces/{namespace}/pods/{name}/binding -> (pods/binding, create)."""
    parts = path.split("?", 1)[0].strip("/").split("/")
    assert parts[:2] == ["api", "v1"], f"not a core API path: {path}"
    rest = parts[2:]
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    resource, named, sub = rest[0], len(rest) > 1, rest[2] if len(rest) > 2 else ""
    verb = VERBS[method]
    if method == "GET" and not named:
        verb = "watch" if "watch" in path else "list"
    return (f"{resource}/{sub}" if sub else resource), verb


def test_rest_permission_reads_paths_as_rbac_does():
    assert rest_permission("POST", "/api/v1/namespaces/{namespace}/pods/{name}/binding") == ("pods/binding", "create")
    assert rest_permission("PATCH", "/api/v1/namespaces/{namespace}/pods/{name}") == ("pods", "patch")
    assert rest_permission("GET", "/api/v1/namespaces/{namespace}/pods/{name}") == ("pods", "get")
    assert rest_permission("POST", "/api/v1/namespaces/{namespace}/bindings") == ("bindings", "create")
    assert rest_permission("GET", "/api/v1/nodes") == ("nodes", "list")


def extender_calls() -> set[tuple[str, str]]:
    """The core API calls the extender's code makes, as (resource, verb):
    the requests it names (METHOD, "/api/v1/..." literals, as
    cgpud/kube/rest.py takes them)."""
    source = "\n".join(p.read_text() for p in sorted((DEPLOY.parent / "cgpud" / "extender").glob("*.py")))
    requests = re.findall(r'"(GET|PATCH|POST|PUT|DELETE)",\s*"(/api/v1/[^"]*)"', source)
    assert requests, "found no API call in cgpud/extender: has the way it calls the API server changed?"
    return {rest_permission(method, path) for method, path in requests}


def test_the_scheduler_rbac_grants_exactly_what_the_extender_calls(tmp_path):
    objects = scheduler_objects()
    granted = {
        (resource, verb)
        for rule in objects["ClusterRole"]["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        if rule["apiGroups"] == [""]
    }
    assert all(rule["apiGroups"] == [""] for rule in objects["ClusterRole"]["rules"])
    needed = extender_calls()
    # bind reads a pod it did not see; its Binding carries the annotations
    assert {("pods", "get"), ("pods/binding", "create")} <= needed and ("pods", "patch") not in needed
    assert needed - granted == set(), "the extender calls what its ClusterRole does not grant"
    # Node discovery (get/list/watch of the annotation) is granted for the API-server mode.
    assert granted - needed <= {("nodes", "get"), ("nodes", "list"), ("nodes", "watch")}
    binding = objects["ClusterRoleBinding"]
    [decoded] = kubectl(
        "set", "subject", "--local", "-f", str(alone(tmp_path, binding)), "--serviceaccount=kube-system:check"
    )
    assert missing(binding, decoded) == []
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": objects["ClusterRole"]["metadata"]["name"],
    }
    account = objects["ServiceAccount"]["metadata"]
    assert {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]} in binding["subjects"]
    assert objects["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == account["name"]


def test_the_admission_policy_binds_cgpud_to_what_it_writes_on_its_own_node(tmp_path):
    """deploy/cgpud-admission-policy.yaml: every field is the API's (kubectl
    decodes it back whole), it matches the writes cgpud's RBAC allows, and
    its expressions name the very keys cgpud writes. The expressions are
    evaluated by a real API server only (not here: no cluster in this test)."""
    from cgpud.kube.model import ANNOTATION_ASSIGNED, ANNOTATION_CAPACITY_ADDRESS

    objects = {d["kind"]: d for d in documents("cgpud-admission-policy.yaml")}
    policy, binding = objects["ValidatingAdmissionPolicy"], objects["ValidatingAdmissionPolicyBinding"]
    for obj in (policy, binding):
        [decoded] = kubectl("label", "--local", "-f", str(alone(tmp_path, obj)), "checked=yes")
        assert missing(obj, decoded) == []
    assert binding["spec"]["policyName"] == policy["metadata"]["name"] and binding["spec"]["validationActions"] == [
        "Deny"
    ]
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    [who] = spec["matchConditions"]
    assert "system:serviceaccount:kube-system:cgpud" in who["expression"]
    rbac = {d["kind"]: d for d in documents("cgpud-rbac.yaml")}
    assert rbac["ServiceAccount"]["metadata"]["name"] == "cgpud"
    writes = {
        (r, v)
        for rule in rbac["ClusterRole"]["rules"]
        for r in rule["resources"]
        for v in rule["verbs"]
        if v in ("patch", "create", "update", "delete")
    }
    operation = {"patch": "UPDATE", "update": "UPDATE", "create": "CREATE", "delete": "DELETE"}
    matched = {
        (r, op)
        for rule in spec["matchConstraints"]["resourceRules"]
        for r in rule["resources"]
        for op in rule["operations"]
    }
    assert {(r, operation[v]) for r, v in writes} == matched
    text = json.dumps(spec)
    assert "authentication.kubernetes.io/node-name" in text
    assert ANNOTATION_ASSIGNED in text and ANNOTATION_CAPACITY_ADDRESS in text and "aliyun.accelerator/" in text
