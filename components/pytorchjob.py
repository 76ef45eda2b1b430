"""PyTorchJob (kubeflow.org/v1) for the training step: render, check, submit.

The container runs `torchrun -m lightning_modules.train ...` with no rendezvous flags:
torchrun takes them from the PET_* variables the Training Operator injects into each pod
(PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT).
"""
import copy
from dataclasses import dataclass, field

from .crd import schema_errors

TRAIN_MODULE = "lightning_modules.train"
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
CONTAINER = "pytorch"  # the operator finds the training container by this name
# requests and limits per pod: per GPU where it has GPUs (a process and its data loader
# workers per GPU), else these
CPU_PER_GPU, MEMORY_PER_GPU = 8, "64Gi"
CPU_WITHOUT_GPU, MEMORY_WITHOUT_GPU = "2", "8Gi"
SHM_SIZE = "4Gi"  # /dev/shm (memory-backed): NCCL's and the data loader workers' buffers
USER_ID = 1000  # the image's non-root user (Dockerfile)
# writable under the read-only root filesystem: an emptyDir, also HOME (Triton's and
# torch's caches live under it)
SCRATCH = "/tmp"
RDZV_BACKEND = "c10d"  # elastic jobs' rendezvous
# Where a job has a volume shared by its pods, torch.compile's and Triton's caches and
# Triton's autotuning choices live on it, in this folder under the mount: each process of
# each later job loads the kernels and choices the first one compiled and timed instead of
# compiling and timing them again (on a fresh GPU machine, minutes a process; the caches
# under HOME, on a pod's scratch volume, go with the pod)
COMPILE_CACHE = ".cache"


def compile_cache_env(root: str) -> dict[str, str]:
    """The variables that put the compile caches under root/COMPILE_CACHE (Triton's cache
    writes each entry to a temporary file renamed into place, so pods may share it)."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": f"{root}/{COMPILE_CACHE}/inductor",
        "TRITON_CACHE_DIR": f"{root}/{COMPILE_CACHE}/triton",
        "TRITON_CACHE_AUTOTUNING": "1",
    }


@dataclass
class JobSpec:
    name: str
    image: str
    train_args: list[str]
    namespace: str = "default"
    nodes: int = 2  # pods: one Master plus nodes - 1 Workers (elastic: nodes Workers)
    nproc_per_node: int | None = None  # training processes per pod; default one per GPU, or 1
    cpu: str | None = None  # per pod; default CPU_PER_GPU per GPU, or CPU_WITHOUT_GPU
    memory: str | None = None  # per pod; default MEMORY_PER_GPU per GPU, or MEMORY_WITHOUT_GPU
    gpus: int = 0
    restart_policy: str = "OnFailure"
    backoff_limit: int = 3
    pvc: str | None = None  # a volume shared by every pod and pipeline step
    mount_path: str = "/workspace"
    env: dict[str, str] = field(default_factory=dict)
    shm_size: str = SHM_SIZE
    elastic: tuple[int, int] | None = None  # (min, max) pods: an elastic job between them
    max_restarts: int = 3  # elastic: restarts of the workers' group
    compile_cache: bool = True  # with a pvc: the compile caches on it (COMPILE_CACHE)

    def procs_per_node(self) -> int:
        return self.nproc_per_node if self.nproc_per_node is not None else max(self.gpus, 1)

    def environment(self) -> dict[str, str]:
        """The training container's variables: HOME on the scratch volume, the compile
        caches on the shared volume where there is one (compile_cache), then `env`, which
        overrides either."""
        cache = compile_cache_env(self.mount_path.rstrip("/")) if self.pvc and self.compile_cache else {}
        return {"HOME": SCRATCH} | cache | self.env

    def resources(self) -> dict[str, str]:
        """One pod's requests (= limits)."""
        if self.gpus:
            memory = self.memory or f"{int(MEMORY_PER_GPU.removesuffix('Gi')) * self.gpus}Gi"
            out = {"cpu": self.cpu or str(CPU_PER_GPU * self.gpus), "memory": memory, "nvidia.com/gpu": str(self.gpus)}
        else:
            out = {"cpu": self.cpu or CPU_WITHOUT_GPU, "memory": self.memory or MEMORY_WITHOUT_GPU}
        return out


def check(spec: JobSpec) -> None:
    if spec.nodes < 1 or spec.procs_per_node() < 1:
        raise ValueError("nodes and nproc_per_node must be at least 1")
    if spec.gpus and spec.procs_per_node() > spec.gpus:
        raise ValueError(f"nproc_per_node {spec.procs_per_node()} is more than the pod's {spec.gpus} GPUs")
    if spec.elastic is not None:
        low, high = spec.elastic
        if not 1 <= low <= spec.nodes <= high:
            raise ValueError(f"elastic pods (min {low}, max {high}) must satisfy 1 <= min <= nodes ({spec.nodes}) <= max")


def pod_spec(spec: JobSpec, container_name: str = CONTAINER) -> dict:
    """The pod template's spec: non-root, no privilege escalation, no capabilities, a
    read-only root filesystem with memory-backed /dev/shm, scratch and workspace volumes."""
    resources = spec.resources()
    env = spec.environment()
    container = {
        "name": container_name,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["torchrun", "-m", TRAIN_MODULE, *spec.train_args],
        "env": [{"name": k, "value": str(v)} for k, v in sorted(env.items())],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "scratch", "mountPath": SCRATCH},
            {"name": "workspace", "mountPath": spec.mount_path},
        ],
    }
    workspace = {"persistentVolumeClaim": {"claimName": spec.pvc}} if spec.pvc else {"emptyDir": {}}
    return {
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": USER_ID, "runAsGroup": USER_ID, "fsGroup": USER_ID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
            {"name": "scratch", "emptyDir": {}},
            {"name": "workspace", **workspace},
        ],
    }


def render(spec: JobSpec) -> dict:
    """The PyTorchJob object for `spec`, as a dict ready for YAML or the API."""
    check(spec)
    pod = pod_spec(spec)

    def replica(n: int) -> dict:
        return {"replicas": n, "restartPolicy": spec.restart_policy, "template": {"spec": copy.deepcopy(pod)}}

    job_spec: dict = {"nprocPerNode": str(spec.procs_per_node())}
    if spec.elastic is not None:  # Workers alone, rendezvous among themselves
        low, high = spec.elastic
        job_spec["elasticPolicy"] = {
            "rdzvBackend": RDZV_BACKEND, "minReplicas": low, "maxReplicas": high, "maxRestarts": spec.max_restarts,
        }
        replicas = {"Worker": replica(spec.nodes)}
    else:
        replicas = {"Master": replica(1)}
        if spec.nodes > 1:
            replicas["Worker"] = replica(spec.nodes - 1)
    job_spec["runPolicy"] = {"backoffLimit": spec.backoff_limit, "cleanPodPolicy": "None"}
    job_spec["pytorchReplicaSpecs"] = replicas
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": {"app.kubernetes.io/name": "hstu"}},
        "spec": job_spec,
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


def validate(job: dict, crd: dict) -> None:
    """Raises ValueError listing every schema and operator-rule violation."""
    errors = schema_errors(job, crd) + operator_errors(job)
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
