"""Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1) for the training step: a
ClusterTrainingRuntime that runs the project's image with torchrun, and the TrainJob that
references it; render, check, submit.

The runtime holds what every job of the project shares: one replicated job "node" (the
trainer, whose container Trainer v2 finds by the name "node"), its pod as the PyTorchJob's
(non-root, read-only root filesystem, /dev/shm, scratch and workspace volumes) and the
torch ML policy. The TrainJob gives the number of nodes, processes per node, resources,
image, command and arguments. Trainer v2's torch plugin injects PET_NNODES,
PET_NPROC_PER_NODE, PET_NODE_RANK (the pod's job completion index), PET_MASTER_ADDR (the
first node's pod) and PET_MASTER_PORT (MASTER_PORT below), which `torchrun` reads.
"""
import copy

from .crd import schema_errors
from .pytorchjob import TRAIN_MODULE, JobSpec, check, pod_spec

GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
RUNTIME_NAME = "hstu-torch-distributed"
NODE = "node"  # the trainer's replicated job and container, as Trainer v2 names them
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
MASTER_PORT = 29400  # the port Trainer v2 gives the first node's rendezvous


def render_runtime(spec: JobSpec, name: str = RUNTIME_NAME) -> dict:
    """The ClusterTrainingRuntime (cluster-scoped) for jobs like `spec`."""
    pod = pod_spec(spec, NODE)
    node = pod["containers"][0]
    node["command"] = ["torchrun", "-m", TRAIN_MODULE]
    for key in ("resources", "env"):  # each TrainJob gives its own
        node.pop(key)
    return {
        "apiVersion": API_VERSION,
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "hstu"}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},  # nodes and processes: each TrainJob gives them
            "template": {"spec": {"replicatedJobs": [{
                "name": NODE,
                "template": {
                    "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                    "spec": {"template": {"spec": pod}},
                },
            }]}},
        },
    }


def render(spec: JobSpec, runtime: str = RUNTIME_NAME) -> dict:
    """The TrainJob for `spec` on the runtime named `runtime`. Elastic jobs are not a
    Trainer v2 feature (it has no elastic torch policy): refused."""
    check(spec)
    if spec.elastic is not None:
        raise ValueError("elastic jobs need the PyTorchJob API (Trainer v2 has no elastic policy)")
    resources = spec.resources()
    env = spec.environment()
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": {"app.kubernetes.io/name": "hstu"}},
        "spec": {
            "runtimeRef": {"apiGroup": GROUP, "kind": "ClusterTrainingRuntime", "name": runtime},
            "trainer": {
                "image": spec.image,
                "command": ["torchrun", "-m", TRAIN_MODULE],
                "args": list(spec.train_args),
                "numNodes": spec.nodes,
                "numProcPerNode": spec.procs_per_node(),
                "resourcesPerNode": {"requests": dict(resources), "limits": dict(resources)},
                "env": [{"name": k, "value": str(v)} for k, v in sorted(env.items())],
            },
        },
    }


def trainer_rule_errors(job: dict, runtime: dict | None = None) -> list[str]:
    """Rules Trainer v2 enforces beyond the schemas: the runtime a job names, torchrun's
    reserved variables left to the torch plugin."""
    errors = []
    ref = job.get("spec", {}).get("runtimeRef", {})
    if runtime is not None and (ref.get("kind"), ref.get("name")) != (runtime["kind"], runtime["metadata"]["name"]):
        errors.append(f"runtimeRef {ref.get('kind')}/{ref.get('name')} is not the runtime given ({runtime['metadata']['name']})")
    reserved = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
    given = {e.get("name") for e in job.get("spec", {}).get("trainer", {}).get("env", [])} & reserved
    if given:
        errors.append(f"trainer env must not set torchrun's reserved variables: {sorted(given)}")
    if runtime is not None:
        jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
        trainers = [j for j in jobs if j.get("template", {}).get("metadata", {}).get("labels", {}).get(ANCESTOR_LABEL) == "trainer"]
        containers = [c["name"] for j in trainers for c in j["template"]["spec"]["template"]["spec"]["containers"]]
        if NODE not in containers:
            errors.append(f"the runtime has no trainer container named {NODE!r}")
    return errors


def validate(job: dict, runtime: dict, trainjob_crd: dict, runtime_crd: dict) -> None:
    """Raises ValueError listing every schema and Trainer v2 rule violation of both objects."""
    errors = [f"TrainJob {e}" for e in schema_errors(job, trainjob_crd)]
    errors += [f"ClusterTrainingRuntime {e}" for e in schema_errors(runtime, runtime_crd)]
    errors += trainer_rule_errors(job, runtime)
    if errors:
        raise ValueError("invalid TrainJob:\n  " + "\n  ".join(errors))


def node_envs(job: dict, master_addr: str = "127.0.0.1", master_port: int = MASTER_PORT) -> list[tuple[str, dict]]:
    """(pod name, environment) of each node as Trainer v2 sets it up: the TrainJob's env,
    then the torch plugin's PET_* variables (the first node as master, here at
    master_addr rather than its pod's DNS name)."""
    trainer = job["spec"]["trainer"]
    name = job["metadata"]["name"]
    base = {e["name"]: e["value"] for e in trainer.get("env", [])}
    nodes = trainer.get("numNodes", 1)
    out = []
    for index in range(nodes):
        env = copy.copy(base) | {
            "PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
            "PET_NODE_RANK": str(index), "PET_MASTER_ADDR": master_addr, "PET_MASTER_PORT": str(master_port),
        }
        out.append((f"{name}-{NODE}-0-{index}", env))
    return out


def submit(job: dict, runtime: dict | None = None, api=None, timeout_s: int = 24 * 3600, poll_s: float = 10.0) -> None:
    """Creates the runtime (if given and absent) and the TrainJob through the Kubernetes API
    and waits for the job to complete (raises if it fails). `api`: a
    kubernetes.client.CustomObjectsApi (default: from the kubeconfig or the pod's account)."""
    import time

    if api is None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.CustomObjectsApi()
    if runtime is not None:
        try:
            api.get_cluster_custom_object(GROUP, VERSION, "clustertrainingruntimes", runtime["metadata"]["name"])
        except Exception as e:  # kubernetes.client.ApiException
            status = getattr(e, "status", None)
            if status == 404:  # not there: create it
                api.create_cluster_custom_object(GROUP, VERSION, "clustertrainingruntimes", runtime)
            elif status != 403:  # 403: no right to read cluster objects; the platform applied it
                raise
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "trainjobs", job)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = api.get_namespaced_custom_object(GROUP, VERSION, namespace, "trainjobs", name).get("status", {})
        conditions = {c["type"]: c for c in status.get("conditions", []) if c.get("status") == "True"}
        if "Complete" in conditions:
            return
        if "Failed" in conditions:
            raise RuntimeError(f"TrainJob {namespace}/{name} failed: {conditions['Failed'].get('message', '')}")
        time.sleep(poll_s)
    raise TimeoutError(f"TrainJob {namespace}/{name} did not complete in {timeout_s} s")
