"""Runs a rendered PyTorchJob on this machine: the Master's and Workers' own command, once
per replica, with the environment the Training Operator injects into each pod."""
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


def launch(job: dict, timeout_s: float | None = None) -> None:
    """Starts every replica's command as a local process and waits; raises if one fails."""
    bin_dir = os.path.dirname(sys.executable)  # the project's environment stands in for the image
    procs = []
    for name, env in replica_envs(job):
        kind = "Master" if "-master-" in name else "Worker"
        c = _container(job, kind)
        command = list(c["command"]) + list(c.get("args", []))
        command[0] = shutil.which(command[0], path=bin_dir + os.pathsep + os.environ.get("PATH", "")) or command[0]
        full_env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
        full_env |= {e["name"]: e["value"] for e in c.get("env", [])} | env
        procs.append((name, subprocess.Popen(command, env=full_env, cwd=c.get("workingDir") or Path.cwd())))
    failed = []
    for name, p in procs:
        if p.wait(timeout=timeout_s) != 0:
            failed.append(f"{name} exited with {p.returncode}")
    if failed:
        raise RuntimeError("PyTorchJob failed: " + "; ".join(failed))
