"""PyTorchJob (kubeflow.org/v1) for the training step: render, check, submit.

The container runs `torchrun -m lightning_modules.train ...` with no rendezvous flags:
torchrun takes them from the PET_* variables the Training Operator injects into each pod
(PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT).
"""
import copy
from dataclasses import dataclass, field

TRAIN_MODULE = "lightning_modules.train"
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
CONTAINER = "pytorch"  # the operator finds the training container by this name


@dataclass
class JobSpec:
    name: str
    image: str
    train_args: list[str]
    namespace: str = "default"
    nodes: int = 2  # pods: one Master plus nodes - 1 Workers
    nproc_per_node: int = 1
    cpu: str = "2"
    memory: str = "8Gi"
    gpus: int = 0
    restart_policy: str = "OnFailure"
    backoff_limit: int = 3
    pvc: str | None = None  # a volume shared by every pod and pipeline step
    mount_path: str = "/workspace"
    env: dict[str, str] = field(default_factory=dict)


def render(spec: JobSpec) -> dict:
    """The PyTorchJob object for `spec`, as a dict ready for YAML or the API."""
    if spec.nodes < 1 or spec.nproc_per_node < 1:
        raise ValueError("nodes and nproc_per_node must be at least 1")
    resources = {"cpu": spec.cpu, "memory": spec.memory}
    if spec.gpus:
        resources["nvidia.com/gpu"] = str(spec.gpus)
    container = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["torchrun", "-m", TRAIN_MODULE, *spec.train_args],
        "env": [{"name": k, "value": str(v)} for k, v in sorted(spec.env.items())],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
    }
    pod = {"containers": [container]}
    if spec.pvc:
        container["volumeMounts"] = [{"name": "workspace", "mountPath": spec.mount_path}]
        pod["volumes"] = [{"name": "workspace", "persistentVolumeClaim": {"claimName": spec.pvc}}]

    def replica(n: int) -> dict:
        return {"replicas": n, "restartPolicy": spec.restart_policy, "template": {"spec": copy.deepcopy(pod)}}

    replicas = {"Master": replica(1)}
    if spec.nodes > 1:
        replicas["Worker"] = replica(spec.nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": {"app.kubernetes.io/name": "hstu"}},
        "spec": {
            "nprocPerNode": str(spec.nproc_per_node),
            "runPolicy": {"backoffLimit": spec.backoff_limit, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": replicas,
        },
    }


def operator_errors(job: dict) -> list[str]:
    """Rules the Training Operator enforces beyond the CRD schema."""
    errors = []
    if job.get("apiVersion") != "kubeflow.org/v1" or job.get("kind") != "PyTorchJob":
        errors.append("apiVersion/kind must be kubeflow.org/v1 PyTorchJob")
    replicas = job.get("spec", {}).get("pytorchReplicaSpecs", {})
    if set(replicas) - {"Master", "Worker"}:
        errors.append(f"unknown replica types {sorted(set(replicas) - {'Master', 'Worker'})}")
    if "Master" in replicas and replicas["Master"].get("replicas", 1) != 1:
        errors.append("Master must have exactly 1 replica")
    if "elasticPolicy" in job.get("spec", {}) and "Worker" not in replicas:
        errors.append("elasticPolicy needs a Worker replica spec")
    for kind, r in replicas.items():
        if r.get("restartPolicy", "Never") not in RESTART_POLICIES:
            errors.append(f"{kind}: restartPolicy must be one of {RESTART_POLICIES}")
        names = [c.get("name") for c in r.get("template", {}).get("spec", {}).get("containers", [])]
        if CONTAINER not in names:
            errors.append(f"{kind}: no container named {CONTAINER!r} (has {names})")
    return errors


def closed_schema(schema: dict) -> dict:
    """The CRD schema with objects closed: the API server drops or rejects fields it does not
    know, except where the schema says x-kubernetes-preserve-unknown-fields."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for v in node.values():
                close(v)
        elif isinstance(node, list):
            for v in node:
                close(v)

    close(schema)
    return schema


def validate(job: dict, crd: dict) -> None:
    """Raises ValueError listing every schema and operator-rule violation."""
    import jsonschema

    version = next(v for v in crd["spec"]["versions"] if v["name"] == job.get("apiVersion", "").split("/")[-1])
    validator = jsonschema.Draft7Validator(closed_schema(version["schema"]["openAPIV3Schema"]))
    errors = [f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in validator.iter_errors(job)]
    errors += operator_errors(job)
    if errors:
        raise ValueError("invalid PyTorchJob:\n  " + "\n  ".join(errors))


def submit(job: dict, client=None, timeout_s: int = 24 * 3600) -> None:
    """Creates the job on the cluster and waits for it to succeed (raises if it fails)."""
    if client is None:
        from kubeflow.training import TrainingClient

        client = TrainingClient()
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    # the SDK's Kubernetes client takes the rendered dict as it is
    client.custom_api.create_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", job)
    client.wait_for_job_conditions(name=name, namespace=namespace, job_kind="PyTorchJob", wait_timeout=timeout_s)
