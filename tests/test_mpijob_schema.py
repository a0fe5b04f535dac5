"""docker/k8s/mpijob.yaml against the APIs it is written for, without a cluster.

- The PersistentVolumeClaim and both pod templates against the Kubernetes API's own OpenAPI schemas
  (the `kubernetes-validate` package, strict: an unknown or misspelt field fails, as `kubectl apply
  --validate=strict` would), for KUBERNETES_VERSION.
- The MPIJob's own fields against the Kubeflow MPI Operator's v2beta1 API, as its CRD
  (manifests/base/kubeflow.org_mpijobs.yaml of kubeflow/mpi-operator v0.8.0), its defaults
  (pkg/apis/kubeflow/v2beta1/default.go) and its validation (pkg/apis/kubeflow/validation) define
  them. MPIJOB_SPEC below is written from those files, for the fields this manifest uses and their
  neighbours; a field the operator does not know fails the test (the CRD would prune it silently).
"""
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

MANIFEST = Path(__file__).resolve().parent.parent / "docker" / "k8s" / "mpijob.yaml"
KUBERNETES_VERSION = "1.37"
MPI_OPERATOR_VERSION = "v0.8.0"

# The v2beta1 MPIJobSpec: field -> (type, allowed values or None). `mpiReplicaSpecs` is the CRD's only
# required field; the operator's validation requires slotsPerWorker, sshAuthMountPath and
# runPolicy.cleanPodPolicy after defaulting (defaults: 1, /root/.ssh, None), so a manifest should
# say them: the default /root/.ssh is not where a non-root image keeps its keys.
MPIJOB_SPEC = {
    "slotsPerWorker": (int, None),  # int32, >= 0
    "runLauncherAsWorker": (bool, None),
    "runPolicy": (dict, None),
    "mpiReplicaSpecs": (dict, None),
    "sshAuthMountPath": (str, None),
    # An enum in types.go (the CRD's marker is malformed, so the API server does not enforce it:
    # a misspelt value would silently mean AtStartup).
    "launcherCreationPolicy": (str, {"AtStartup", "WaitForWorkersReady"}),
    "mpiImplementation": (str, {"OpenMPI", "Intel", "MPICH"}),
}
RUN_POLICY = {
    "cleanPodPolicy": (str, {"None", "Running", "All"}),
    "ttlSecondsAfterFinished": (int, None),
    "activeDeadlineSeconds": (int, None),
    "backoffLimit": (int, None),
    "schedulingPolicy": (dict, None),
    "suspend": (bool, None),
    "managedBy": (str, {"kubeflow.org/mpi-operator", "kueue.x-k8s.io/multikueue"}),
}
REPLICA_SPEC = {
    "replicas": (int, None),
    # Validation accepts only these two (the CRD's description also names Always and ExitCode).
    "restartPolicy": (str, {"Never", "OnFailure"}),
    "template": (dict, None),
}
REPLICA_TYPES = {"Launcher", "Worker"}
REQUIRED = {"mpiReplicaSpecs", "slotsPerWorker", "sshAuthMountPath", "runPolicy"}
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def documents() -> dict:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def check_fields(obj: dict, fields: dict, where: str) -> list[str]:
    """What in `obj` the operator's API does not accept: unknown fields, wrong types, values."""
    problems = []
    for name, value in obj.items():
        if name not in fields:
            problems.append(f"{where}.{name}: not a field of the MPI Operator's v2beta1 API")
            continue
        kind, allowed = fields[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            problems.append(f"{where}.{name}: {value!r} is not of type {kind.__name__}")
        elif allowed is not None and value not in allowed:
            problems.append(f"{where}.{name}: {value!r} is not one of {sorted(allowed)}")
        elif kind is int and value < 0:
            problems.append(f"{where}.{name}: {value} is negative")
    return problems


def mpijob_problems(job: dict) -> list[str]:
    """The MPI Operator's v2beta1 API and validation, for one MPIJob."""
    problems = []
    if job.get("apiVersion") != "kubeflow.org/v2beta1":
        problems.append(f"apiVersion {job.get('apiVersion')!r} is not kubeflow.org/v2beta1")
    spec = job["spec"]
    problems += [f"spec.{name}: required" for name in sorted(REQUIRED - spec.keys())]
    problems += check_fields(spec, MPIJOB_SPEC, "spec")
    policy = spec.get("runPolicy", {})
    if "cleanPodPolicy" not in policy:
        problems.append("spec.runPolicy.cleanPodPolicy: required")
    problems += check_fields(policy, RUN_POLICY, "spec.runPolicy")
    replicas = spec.get("mpiReplicaSpecs", {})
    if "Launcher" not in replicas:
        problems.append("spec.mpiReplicaSpecs.Launcher: required")
    for role, replica in replicas.items():
        where = f"spec.mpiReplicaSpecs.{role}"
        if role not in REPLICA_TYPES:
            problems.append(f"{where}: not one of {sorted(REPLICA_TYPES)}")
            continue
        problems += check_fields(replica, REPLICA_SPEC, where)
        if not replica.get("template", {}).get("spec", {}).get("containers"):
            problems.append(f"{where}.template.spec.containers: must define at least one container")
    if replicas.get("Launcher", {}).get("replicas", 1) != 1:
        problems.append("spec.mpiReplicaSpecs.Launcher.replicas: must be 1")
    workers = replicas.get("Worker", {}).get("replicas", 1)
    if isinstance(workers, int) and workers < 1:
        problems.append("spec.mpiReplicaSpecs.Worker.replicas: must be at least 1")
    # Every worker pod and its service are named <job>-worker-<i>: a DNS-1035 label.
    last_worker = f"{job['metadata']['name']}-worker-{max(workers, 1) - 1}"
    if len(last_worker) > 63 or not DNS_1035_LABEL.fullmatch(last_worker):
        problems.append(f"metadata.name: {last_worker!r} is not a valid DNS-1035 label")
    return problems


def test_the_claim_is_a_valid_kubernetes_object():
    kubernetes_validate.validate(documents()["PersistentVolumeClaim"], KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("role", sorted(REPLICA_TYPES))
def test_the_pod_template_is_valid_for_the_kubernetes_api(role):
    template = documents()["MPIJob"]["spec"]["mpiReplicaSpecs"][role]["template"]
    # A PodTemplate is the API object that holds a bare PodTemplateSpec, as the MPIJob does.
    pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
                    "template": template}
    kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_rejects_what_the_api_server_would():
    """The same check, on a template with a misspelt field and one of the wrong type."""
    template = documents()["MPIJob"]["spec"]["mpiReplicaSpecs"]["Worker"]["template"]
    for spoil in ({"terminationGracePeriodSecond": 180}, {"terminationGracePeriodSeconds": "180"}):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "worker"},
                        "template": {**template, "spec": {**template["spec"], **spoil}}}
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)


def test_the_mpijob_fields_are_those_of_the_mpi_operator_v2beta1_api():
    assert mpijob_problems(documents()["MPIJob"]) == []


@pytest.mark.parametrize("spoil, problem", [
    ({"sshAuthMountPath": None}, "spec.sshAuthMountPath: required"),
    ({"slotsPerWorker": "8"}, "spec.slotsPerWorker: '8' is not of type int"),
    ({"launcherCreationPolicy": "WaitForWorkers"}, "spec.launcherCreationPolicy: 'WaitForWorkers' is not one of"),
    ({"runPolicy": {"cleanPodPolicy": "Finished"}}, "spec.runPolicy.cleanPodPolicy: 'Finished' is not one of"),
    ({"runPolicy": {"backoffLimit": 3}}, "spec.runPolicy.cleanPodPolicy: required"),
    ({"cleanPodPolicy": "Running"}, "spec.cleanPodPolicy: not a field"),  # v1's place for it
    ({"slotsPerWorker": -1}, "spec.slotsPerWorker: -1 is negative"),
], ids=lambda v: str(v)[:40])
def test_the_mpijob_check_rejects_what_the_operator_would(spoil, problem):
    job = documents()["MPIJob"]
    spec = {**job["spec"], **spoil}
    spec = {k: v for k, v in spec.items() if v is not None}
    problems = mpijob_problems({**job, "spec": spec})
    assert any(p.startswith(problem) for p in problems), problems


def test_the_docs_name_the_operator_version_and_what_was_checked():
    clusters = (MANIFEST.parent.parent.parent / "docs" / "clusters.md").read_text()
    kubernetes = clusters[clusters.index("## Kubernetes"):]
    kubernetes = kubernetes[:kubernetes.index("\n## ", 1)]
    assert f"MPI Operator {MPI_OPERATOR_VERSION}" in kubernetes and f"Kubernetes {KUBERNETES_VERSION}" in kubernetes
    assert "tests/test_mpijob_schema.py" in kubernetes
