"""deploy/kubernetes/: every manifest against the Kubernetes schemas, the ConfigMap's TOML through gear's own
loader and a real daemon, and the references between the objects (labels, ports, paths, the Secret)."""

from __future__ import annotations

import posixpath
import re
import tomllib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gear_server.config import load_config
from tests.support.daemon_process import DaemonProcess
from tests.support.paths import ROOT
from tests.support.ports import free_port

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the dev extra)")

K8S = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "deploy" / "container" / "Dockerfile"
KUBERNETES_VERSION = "1.33.0"  # the schemas checked against (kubernetes-validate ships them)


def _documents() -> dict[str, dict]:
    """kind -> the object, over every manifest (kustomization.yaml is kustomize's, not an API object)."""
    out: dict[str, dict] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in out, f"two {doc['kind']} objects: {path.name}"
            out[doc["kind"]] = doc | {"_file": path.name}
    return out


DOCS = _documents()


def _object(kind: str) -> dict:
    return {k: v for k, v in DOCS[kind].items() if k != "_file"}


def _pod(kind: str) -> dict:
    return DOCS[kind]["spec"]["template"]["spec"]


def _daemon() -> dict:
    (container,) = _pod("DaemonSet")["containers"]
    return container


def _config_text() -> str:
    return DOCS["ConfigMap"]["data"]["gear-server.toml"]


def _mount_of(container: dict, path: str) -> tuple[dict, dict]:
    """The volume mount holding ``path`` (the deepest one) and its volume."""
    mounts = [m for m in container["volumeMounts"] if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")]
    assert mounts, f"no volume is mounted at or above {path}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volumes = {v["name"]: v for v in _pod("DaemonSet")["volumes"]}
    return mount, volumes[mount["name"]]


@pytest.mark.parametrize("kind", sorted(DOCS))
def test_every_manifest_is_valid_kubernetes(kind):
    """Strict schema validation: a misspelt field or a wrong type fails here, not at kubectl apply."""
    try:
        kubernetes_validate.validate(_object(kind), KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{DOCS[kind]['_file']}: {exc.message} at {'/'.join(map(str, exc.path))}")


def test_the_kustomization_installs_the_daemons_and_nothing_secret():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    resources = set(kustomization["resources"])
    for name in resources:
        assert (K8S / name).is_file(), name
    kinds = {DOCS[kind]["_file"]: kind for kind in DOCS}
    assert {kinds[name] for name in resources} == {"Namespace", "ConfigMap", "DaemonSet", "Service",
                                                   "PodDisruptionBudget"}
    assert DOCS["Secret"]["_file"] not in resources  # made with a random token, never applied as a placeholder
    namespace = DOCS["Namespace"]["metadata"]["name"]
    assert {DOCS[kind]["metadata"].get("namespace") for kind in DOCS if kind != "Namespace"} == {namespace}


def test_the_configmap_toml_loads_with_gears_own_loader(tmp_path):
    path = tmp_path / "gear-server.toml"
    path.write_text(_config_text())
    settings = load_config(path)
    assert settings.server.port == 8000 and settings.server.shm_dir == "/dev/shm"
    assert [t.name for t in settings.server.tables] == ["replay"]
    assert settings.metrics.enabled and settings.metrics.bind == "0.0.0.0"  # scraped from other hosts
    assert settings.checkpoint.on_stop and settings.checkpoint.restore
    assert settings.auth.token_file and settings.auth.public_health  # the kubelet's probes carry no token
    assert settings.ingest.workers == 0 or _pod("DaemonSet")["hostNetwork"]  # worker ports are picked at start


def test_the_daemonset_runs_the_configmap_and_the_service_lists_it():
    pod, container = _pod("DaemonSet"), _daemon()
    config = tomllib.loads(_config_text())
    # --config names the ConfigMap's key where its volume is mounted.
    config_path = container["command"][container["command"].index("--config") + 1]
    mount, volume = _mount_of(container, config_path)
    assert volume["configMap"]["name"] == DOCS["ConfigMap"]["metadata"]["name"]
    assert posixpath.relpath(config_path, mount["mountPath"]) in DOCS["ConfigMap"]["data"]
    # The headless Service selects the daemons; its ports are the config's.
    service = DOCS["Service"]["spec"]
    labels = DOCS["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    assert service["clusterIP"] == "None"
    assert service["selector"].items() <= labels.items()
    assert DOCS["DaemonSet"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert DOCS["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"]: p["targetPort"] for p in service["ports"]}
    assert ports == {"grpc": config["port"], "metrics": config["metrics"]["port"]}
    assert {p["containerPort"] for p in container["ports"]} == {config["port"], config["metrics"]["port"]}
    # Probes speak grpc.health.v1 to the control plane's port.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == config["port"], probe
    annotations = DOCS["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == config["metrics"]["port"]
    # The host network carries the control plane and whatever bulk ports the daemon advertises.
    assert pod["hostNetwork"] and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    # Time for the final checkpoint after SIGTERM.
    assert pod["terminationGracePeriodSeconds"] >= 600


def test_shm_checkpoints_and_token_are_where_the_config_says():
    container = _daemon()
    config = tomllib.loads(_config_text())
    # /dev/shm: memory, capped, under the container's memory limit.
    mount, volume = _mount_of(container, config["shm_dir"])
    assert mount["mountPath"] == config["shm_dir"]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert _bytes(volume["emptyDir"]["sizeLimit"]) < _bytes(container["resources"]["limits"]["memory"])
    # Checkpoints on the node's disk (they outlive the pod), writable by the daemon's user.
    _, volume = _mount_of(container, config["checkpoint"]["dir"])
    assert volume["hostPath"]["path"]
    (init,) = _pod("DaemonSet")["initContainers"]
    assert str(_pod("DaemonSet")["securityContext"]["runAsUser"]) in init["command"][-1]
    # The token: the Secret's key, mounted where [auth] token_file points.
    token_file = config["auth"]["token_file"]
    mount, volume = _mount_of(container, token_file)
    secret = DOCS["Secret"]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (item,) = volume["secret"]["items"]
    assert posixpath.join(mount["mountPath"], item["path"]) == token_file
    assert item["key"] in secret["stringData"]
    assert volume["secret"]["defaultMode"] & 0o007 == 0  # not world-readable (the daemon warns otherwise)


def test_the_daemon_is_hardened_as_the_systemd_unit():
    pod, container = _pod("DaemonSet"), _daemon()
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    context = container["securityContext"]
    assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
    assert context["capabilities"]["drop"] == ["ALL"] and "add" not in context["capabilities"]
    assert not context.get("privileged", False)
    init_context = pod["initContainers"][0]["securityContext"]
    assert init_context["allowPrivilegeEscalation"] is False and set(init_context["capabilities"]["add"]) <= {
        "CHOWN", "FOWNER"}


def test_the_learner_job_uses_the_service_and_the_secret():
    pod = _pod("Job")
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    service = DOCS["Service"]["metadata"]
    port = tomllib.loads(_config_text())["port"]
    assert env["GEAR_SHARDS"]["value"] == f"shards:{service['name']}.{service['namespace']}.svc.cluster.local:{port}"
    ref = env["GEAR_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == DOCS["Secret"]["metadata"]["name"] and ref["key"] in DOCS["Secret"]["stringData"]
    assert container["image"] == _daemon()["image"]
    # The script the Job runs is the one the image copies.
    script = next(arg for arg in container["command"] if arg.endswith(".py"))
    assert re.search(rf"^COPY deploy/gear_learner.py {re.escape(script)}$", DOCKERFILE.read_text(), re.M)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_image_copies_what_exists_and_runs_as_the_pods_user():
    text = DOCKERFILE.read_text()
    sources = [line.split()[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
    assert sources
    for group in sources:
        for source in group:
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
    user = re.search(r"^USER (\d+):(\d+)$", text, re.M)
    context = _pod("DaemonSet")["securityContext"]
    assert (int(user[1]), int(user[2])) == (context["runAsUser"], context["runAsGroup"])
    assert _daemon()["command"][0] == "gear-server"  # the console script pip installs


def test_a_daemon_serves_the_configmap_config(tmp_path):
    """The ConfigMap's TOML, with the pod's paths and ports moved into this test's folder, runs a daemon whose
    gRPC health says SERVING without the token (what the kubelet's probes ask) and whose replay calls need it."""
    token = "k8s-test-token"
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "token").write_text(token)
    (tmp_path / "secret" / "token").chmod(0o600)
    (tmp_path / "shm").mkdir()
    config = tomllib.loads(_config_text())
    text = _config_text()
    for old, new in ((config["shm_dir"], tmp_path / "shm"), (config["checkpoint"]["dir"], tmp_path / "ckpt"),
                     (config["auth"]["token_file"], tmp_path / "secret" / "token")):
        text = text.replace(f'"{old}"', f'"{new}"')
    text = re.sub(r"^port = \d+", "port = 0", text, flags=re.M)
    text = text.replace(f"port = {config['metrics']['port']}", f"port = {free_port()}")
    text = text.replace('bind_address = "[::]"', 'bind_address = "127.0.0.1"')
    text = text.replace('instance_name = "gear"', f'instance_name = "k8s{tmp_path.name[-8:]}"')
    daemon = DaemonProcess(tmp_path, text, name="k8s")
    try:
        port = daemon.wait_ready()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        import gear_client

        with pytest.raises(Exception, match="(?i)unauthenticated|token"):
            gear_client.Client(f"127.0.0.1:{port}", connect_timeout=10).server_info()
        client = gear_client.Client(f"127.0.0.1:{port}", token=token, connect_timeout=10)
        assert client.server_info()["replay"].max_size == config["tables"][0]["max_size"]
        client.close()
    finally:
        daemon.stop()


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)
