"""Runs a rendered training job on this machine: a PyTorchJob's Master and Worker commands,
once per replica, with the environment the Training Operator injects into each pod; or a
Trainer v2 TrainJob's command once per node, with the environment its torch plugin sets."""
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_envs(job: dict, master_addr: str = "127.0.0.1", master_port: int | None = None) -> list[tuple[str, dict]]:
    """(replica name, injected environment) for every pod, Master first: RANK is the pod's
    index, WORLD_SIZE = pods × nprocPerNode, as the operator sets them. An elastic job's
    pods (Workers alone) also get torchrun's rendezvous settings: the c10d backend at the
    first pod's address, PET_NNODES min:max and PET_MAX_RESTARTS."""
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    order = [(kind, replicas[kind]) for kind in ("Master", "Worker") if kind in replicas]
    elastic = spec.get("elasticPolicy")
    pods = sum(r.get("replicas", 1) for _, r in order)
    nproc = spec.get("nprocPerNode", "1")
    nproc_int = int(nproc) if str(nproc).isdigit() else 1
    port = master_port or free_port()
    envs, index = [], 0
    for kind, r in order:
        for i in range(r.get("replicas", 1)):
            env = {
                "MASTER_ADDR": master_addr, "MASTER_PORT": str(port),
                "WORLD_SIZE": str(pods * nproc_int), "RANK": str(index),
                "PET_MASTER_ADDR": master_addr, "PET_MASTER_PORT": str(port),
                "PET_NNODES": str(pods), "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(index),
                "PYTHONUNBUFFERED": "1",
            }
            if elastic:
                env |= {
                    "PET_RDZV_BACKEND": elastic.get("rdzvBackend", "c10d"), "PET_RDZV_ENDPOINT": f"{master_addr}:{port}",
                    "PET_NNODES": f"{elastic['minReplicas']}:{elastic['maxReplicas']}",
                    "PET_MAX_RESTARTS": str(elastic.get("maxRestarts", 0)),
                }
            envs.append((f"{job['metadata']['name']}-{kind.lower()}-{i}", env))
            index += 1
    return envs


def _container(job: dict, kind: str) -> dict:
    pod = job["spec"]["pytorchReplicaSpecs"][kind]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "pytorch")


def _processes(job: dict) -> list[tuple[str, list[str], dict]]:
    """(pod name, command, environment) of each pod of a PyTorchJob or a TrainJob."""
    if job.get("kind") == "TrainJob":
        from components.trainjob import node_envs

        trainer = job["spec"]["trainer"]
        command = list(trainer["command"]) + list(trainer.get("args", []))
        return [(name, command, env) for name, env in node_envs(job, master_port=free_port())]
    out = []
    for name, env in replica_envs(job):
        c = _container(job, "Master" if "-master-" in name else "Worker")
        out.append((name, list(c["command"]) + list(c.get("args", [])), {e["name"]: e["value"] for e in c.get("env", [])} | env))
    return out


def launch(*docs: dict, timeout_s: float | None = None) -> None:
    """Starts every pod's command of the job among docs (a PyTorchJob, or a TrainJob beside
    its runtime) as a local process and waits; raises if one fails."""
    jobs = [d for d in docs if d.get("kind") in ("PyTorchJob", "TrainJob")]
    if len(jobs) != 1:
        raise ValueError(f"expected one PyTorchJob or TrainJob, got kinds {[d.get('kind') for d in docs]}")
    bin_dir = os.path.dirname(sys.executable)  # the project's environment stands in for the image
    path = bin_dir + os.pathsep + os.environ.get("PATH", "")
    procs = []
    for name, command, env in _processes(jobs[0]):
        command[0] = shutil.which(command[0], path=path) or command[0]
        procs.append((name, subprocess.Popen(command, env=dict(os.environ, PATH=path) | env, cwd=Path.cwd())))
    failed = []
    for name, p in procs:
        if p.wait(timeout=timeout_s) != 0:
            failed.append(f"{name} exited with {p.returncode}")
    if failed:
        raise RuntimeError("PyTorchJob failed: " + "; ".join(failed))
