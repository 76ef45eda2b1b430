"""The pipeline end to end on the local runner, MLflow contents, export, and the cluster path:
compiled IR, PyTorchJob rendering and validation, and the local PyTorchJob launcher."""
import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import yaml
from kfp import components as kfp_components
from mlflow.tracking import MlflowClient

from components import pytorchjob, trainjob
from conftest import check_run_page
from kernels.dynamic_embedding import read_manifest
from lightning_modules.export import Recommender
from pipelines.cli import main as hstu
from pipelines.launcher import replica_envs

TINY = "--max-seq-len 16 --batch-size 8 --num-negatives 16"


def test_the_steps_start_without_lightning():
    """Only training's workers need Lightning: a step's process (a pod on a cluster) that
    prepares, evaluates, dumps or exports, and the one that launches the workers, import
    the steps without it."""
    loaded = "import sys, components.steps; print(sorted(m for m in sys.modules if m.split('.')[0] == 'lightning'))"
    out = subprocess.run([sys.executable, "-c", loaded], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_run_writes_metrics_for_the_model_and_both_baselines(pipeline_run):
    results = json.loads((pipeline_run / "metrics.json").read_text())
    for who in ("model", "sasrec", "most_popular"):
        assert results[who]["users"] == 48
        assert 0 <= results[who]["ndcg@10"] <= results[who]["hr@10"] <= results[who]["hr@50"] <= results[who]["hr@200"] <= 1
    assert results["seed"] == 0
    assert (pipeline_run / "baselines" / "sasrec" / "model" / "model.json").is_file()
    assert results["tracking_uri"] == f"sqlite:///{pipeline_run.resolve() / 'mlflow.db'}"
    # artifacts stay in the work directory, not in ./mlruns of the current directory
    assert any((pipeline_run / "mlartifacts").rglob("training_curve.png"))
    assert not (Path.cwd() / "mlruns").exists()
    # the local runner's warning that the steps name a container image is not repeated at every step
    assert "non-Python base image" not in (pipeline_run / "warnings.txt").read_text()


def test_mlflow_run_has_params_curves_metrics_artifacts_and_a_registered_model(pipeline_run):
    results = json.loads((pipeline_run / "metrics.json").read_text())
    client = MlflowClient(results["tracking_uri"])
    run = client.get_run(results["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["dataset"] == "synthetic" and run.data.params["model/num_blocks"] == "2"
    steps = json.loads((pipeline_run / "train" / "model" / "model.json").read_text())["metadata"]["global_step"]
    loss = client.get_metric_history(run.info.run_id, "train/loss")
    assert len(loss) == steps and steps > 2
    assert run.data.metrics["test/hr_at_10"] == pytest.approx(results["model"]["hr@10"])
    assert run.data.metrics["baseline/most_popular/ndcg_at_10"] == pytest.approx(results["most_popular"]["ndcg@10"])
    assert run.data.metrics["baseline/sasrec/ndcg_at_10"] == pytest.approx(results["sasrec"]["ndcg@10"])
    epochs = len(client.get_metric_history(run.info.run_id, "val/ndcg_at_10"))
    assert epochs == 2  # validated after each epoch
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    assert [c.info.run_name for c in children] == ["sasrec"]
    assert len(client.get_metric_history(children[0].info.run_id, "val/ndcg_at_10")) == 2
    assert run.data.metrics["emb/size"] > 0
    assert {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")} == {
        "evaluation/metrics.json", "evaluation/training_curve.png"}
    check_run_page(results["tracking_uri"], run.info.run_id, pipeline_run / "data")  # the same as on a server
    version = client.get_model_version("hstu", run.data.params["registered_model_version"])
    assert version.run_id == run.info.run_id
    mlflow.set_tracking_uri(results["tracking_uri"])
    served = mlflow.pyfunc.load_model(f"models:/hstu/{version.version}")
    test = pd.read_parquet(pipeline_run / "data" / "test.parquet")
    history, times = test["item_ids"][0].tolist()[:-1], test["timestamps"][0].tolist()[:-1]
    predictions = served.predict(pd.DataFrame({"history": [history], "k": [5]}))
    assert len(predictions[0]) == 5 and not set(predictions[0]) & set(history)
    # with the history's times, as evaluation reads them; rows without times next to rows with them
    rec = Recommender.load(pipeline_run / "export")
    both = served.predict(pd.DataFrame({"history": [history, history], "timestamps": [times, None], "k": [5, 5]}))
    assert both == [[i for i, _ in rec.recommend(history, t, k=5)] for t in (times, None)]


def test_export_loader_returns_topk_for_a_history(pipeline_run, capsys):
    rec = Recommender.load(pipeline_run / "export")
    catalog = set(rec.item_ids.tolist())
    history = list(catalog)[:5]
    top = rec.recommend(history, k=7)
    assert len(top) == 7 and all(i in catalog and i not in history for i, _ in top)
    assert [s for _, s in top] == sorted((s for _, s in top), reverse=True)
    assert len(rec.recommend([], k=3)) == 3  # an empty history still answers
    hstu(["recommend", "--export", str(pipeline_run / "export"), "--history", ",".join(map(str, history)), "-k", "4"])
    assert len(capsys.readouterr().out.strip().splitlines()) == 4
    # the history's times reach the model's time bias: the scores are those of recommend with them
    times = [0, 3600, 7200, 90000, 10**6]
    hstu(["recommend", "--export", str(pipeline_run / "export"), "--history", ",".join(map(str, history)),
          "--timestamps", ",".join(map(str, times)), "-k", "4"])
    printed = [line.split("\t") for line in capsys.readouterr().out.strip().splitlines()]
    assert [(int(i), round(s, 4)) for i, s in ((i, float(s)) for i, s in printed)] == [
        (i, round(s, 4)) for i, s in rec.recommend(history, times, k=4)]
    assert rec.recommend(history, times, k=4) != rec.recommend(history, k=4)
    with pytest.raises(ValueError, match="timestamps has 2 entries, history 5"):
        rec.recommend(history, times[:2])
    with pytest.raises(ValueError, match="k must be at least 1, got 0"):
        rec.recommend(history, k=0)
    with pytest.raises(SystemExit) as e:
        hstu(["recommend", "--export", str(pipeline_run / "export"), "--history", "1,2", "--timestamps", "5"])
    assert e.value.code == 1 and "hstu: error: timestamps has 1 entries, history 2" in capsys.readouterr().err


def test_compiled_pipeline_loads_back_with_kfp(tmp_path):
    path = tmp_path / "pipeline.yaml"
    hstu(["compile", "--out", str(path), "--image", "registry.example/hstu:1", "--pvc", "hstu-work"])
    component = kfp_components.load_component_from_file(str(path))
    assert component.name == "hstu-train-evaluate-export"
    docs = list(yaml.safe_load_all(path.read_text()))
    root = docs[0]["root"]["dag"]["tasks"]
    assert set(root) == {"exit-handler-1", "close-run"}  # the steps, then the MLflow run's end whatever happened
    assert root["close-run"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    tasks = docs[0]["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    assert set(tasks) == {"open-run", "prepare-data", "train", "train-baselines", "dump", "evaluate", "export"}
    assert tasks["export"]["dependentTasks"] == ["dump", "evaluate", "open-run", "prepare-data"]
    assert tasks["evaluate"]["dependentTasks"] == ["dump", "open-run", "prepare-data", "train-baselines"]
    executors = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert all(e["pvcMount"][0]["constant"] == "hstu-work" for e in executors.values()) and len(executors) == 6
    images = {e["container"]["image"] for e in docs[0]["deploymentSpec"]["executors"].values()}
    assert images == {"registry.example/hstu:1"}


@pytest.fixture(scope="module")
def crd(shared_dir):
    return yaml.safe_load((shared_dir / "schemas" / "kubeflow.org_pytorchjobs.yaml").read_text())


def test_manifest_validates_against_the_crd(tmp_path, crd, shared_dir):
    out = tmp_path / "job.yaml"
    hstu(["manifest", "--data-dir", "/workspace/data", "--out-dir", "/workspace/train", "--nodes", "3",
          "--nproc-per-node", "2", "--gpus", "2", "--pvc", "hstu-work",
          "--schema", str(shared_dir / "schemas" / "kubeflow.org_pytorchjobs.yaml"), "-o", str(out)])
    job = yaml.safe_load(out.read_text())
    pytorchjob.validate(job, crd)
    spec = job["spec"]
    assert spec["pytorchReplicaSpecs"]["Master"]["replicas"] == 1 and spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    container = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and container["command"][:3] == ["torchrun", "-m", "lightning_modules.train"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    envs = replica_envs(job, master_port=23456)
    assert [e["RANK"] for _, e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for _, e in envs} == {"6"}
    assert {e["PET_NNODES"] for _, e in envs} == {"3"} and envs[2][1]["PET_NODE_RANK"] == "2"


def test_gpu_pods_run_a_process_per_gpu_as_a_non_root_user_and_elastic_jobs_render(tmp_path, crd, capsys):
    out = tmp_path / "job.yaml"
    hstu(["manifest", "--data-dir", "/d", "--out-dir", "/o", "--nodes", "3", "--gpus", "8", "-o", str(out)])
    job = yaml.safe_load(out.read_text())
    pytorchjob.validate(job, crd)
    assert job["spec"]["nprocPerNode"] == "8"  # one process per GPU
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8"}
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == pytorchjob.USER_ID
    security = container["securityContext"]
    assert security == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in volumes[mounts["/tmp"]] and {"name": "HOME", "value": "/tmp"} in container["env"]  # writable
    dockerfile = (Path(__file__).parents[1] / "Dockerfile").read_text()
    assert f"ARG USER_ID={pytorchjob.USER_ID}" in dockerfile and "USER ${USER_ID}" in dockerfile

    hstu(["manifest", "--data-dir", "/d", "--out-dir", "/o", "--nodes", "3", "--gpus", "8", "--nproc-per-node", "4",
          "--elastic", "2:4", "--max-restarts", "5", "-o", str(out)])
    job = yaml.safe_load(out.read_text())
    pytorchjob.validate(job, crd)
    assert job["spec"]["nprocPerNode"] == "4"  # the override is kept
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 4, "maxRestarts": 5}
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Worker"] and job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    envs = replica_envs(job, master_port=29400)
    assert len(envs) == 3 and {e["PET_NNODES"] for _, e in envs} == {"2:4"}
    assert {(e["PET_RDZV_BACKEND"], e["PET_RDZV_ENDPOINT"], e["PET_MAX_RESTARTS"]) for _, e in envs} == {("c10d", "127.0.0.1:29400", "5")}

    for bad, message in ((["--elastic", "4:6"], "min <= nodes"), (["--elastic", "2"], "expected MIN:MAX"),
                         (["--gpus", "2", "--nproc-per-node", "4"], "more than the pod's 2 GPUs")):
        with pytest.raises(SystemExit, match=message):
            hstu(["manifest", "--data-dir", "/d", "--out-dir", "/o", "--nodes", "3", *bad])


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize("nodes", [1, 4])
def test_jobs_of_8_gpu_nodes_run_8_processes_per_node_non_root_with_shared_memory(tmp_path, api, nodes, crd, trainer_crds):
    """1 and 4 nodes of 8 GPUs, either training API: 8 processes per node (the process
    count the controller hands torchrun), 8 GPUs per pod, a memory-backed /dev/shm, a
    non-root read-only container, and the object valid for its CRD."""
    out = tmp_path / "job.yaml"
    hstu(["manifest", "--api", api, "--data-dir", "/d", "--out-dir", "/o", "--nodes", str(nodes), "--gpus", "8", "-o", str(out)])
    if api == "pytorchjob":
        job = yaml.safe_load(out.read_text())
        pytorchjob.validate(job, crd)
        replicas = job["spec"]["pytorchReplicaSpecs"]
        assert sum(r["replicas"] for r in replicas.values()) == nodes and replicas["Master"]["replicas"] == 1
        envs = [e for _, e in replica_envs(job, master_port=29400)]
        assert {e["WORLD_SIZE"] for e in envs} == {str(8 * nodes)}  # processes in all
        pods = [r["template"]["spec"] for r in replicas.values()]
        limits = [p["containers"][0]["resources"]["limits"] for p in pods]
    else:
        runtime, job = yaml.safe_load_all(out.read_text())
        trainjob.validate(job, runtime, *(yaml.safe_load(f.read_text()) for f in trainer_crds))
        assert job["spec"]["trainer"]["numNodes"] == nodes
        envs = [e for _, e in trainjob.node_envs(job, master_port=29400)]
        pods = [runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]]
        limits = [job["spec"]["trainer"]["resourcesPerNode"]["limits"]]
    assert len(envs) == nodes and {(e["PET_NNODES"], e["PET_NPROC_PER_NODE"]) for e in envs} == {(str(nodes), "8")}
    assert sorted(int(e["PET_NODE_RANK"]) for e in envs) == list(range(nodes))
    assert all(limit["nvidia.com/gpu"] == "8" for limit in limits)
    for pod in pods:
        container = pod["containers"][0]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == pytorchjob.USER_ID
        assert container["securityContext"]["readOnlyRootFilesystem"] and not container["securityContext"]["allowPrivilegeEscalation"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert {v["name"]: v for v in pod["volumes"]}[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_jobs_on_a_shared_volume_keep_their_compile_caches_on_it(tmp_path, api):
    """With --pvc, every pod's torch.compile and Triton caches and Triton's autotuning
    choices are on the shared volume (what torch and Triton read from those variables,
    checked in a process given them); without a volume, or with --no-compile-cache, they
    stay under HOME; a variable the job's env gives overrides."""
    def env_of(*extra):
        out = tmp_path / "job.yaml"
        hstu(["manifest", "--api", api, "--data-dir", "/d", "--out-dir", "/o", "--mount-path", "/shared/", *extra, "-o", str(out)])
        doc = list(yaml.safe_load_all(out.read_text()))[-1]
        if api == "pytorchjob":
            containers = [r["template"]["spec"]["containers"][0] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
        else:
            containers = [doc["spec"]["trainer"]]
        envs = [{e["name"]: e["value"] for e in c["env"]} for c in containers]
        assert all(e == envs[0] for e in envs)
        return envs[0]

    shared = env_of("--pvc", "work")
    assert {k: v for k, v in shared.items() if k != "HOME"} == {
        "TORCHINDUCTOR_CACHE_DIR": "/shared/.cache/inductor", "TRITON_CACHE_DIR": "/shared/.cache/triton", "TRITON_CACHE_AUTOTUNING": "1",
    }
    assert env_of() == env_of("--pvc", "work", "--no-compile-cache") == {"HOME": "/tmp"}
    read = ("import triton, torch._inductor.runtime.cache_dir_utils as c; "
            "print(triton.knobs.cache.dir, triton.knobs.autotuning.cache, c.cache_dir())")
    moved = {k: v.replace("/shared", str(tmp_path)) for k, v in shared.items()}
    seen = subprocess.run([sys.executable, "-c", read], env={**os.environ, **moved}, capture_output=True, text=True, check=True)
    assert seen.stdout.split() == [moved["TRITON_CACHE_DIR"], "True", moved["TORCHINDUCTOR_CACHE_DIR"]]
    spec = pytorchjob.JobSpec(name="j", image="i", train_args=[], pvc="work", env={"TRITON_CACHE_DIR": "/elsewhere"})
    assert spec.environment()["TRITON_CACHE_DIR"] == "/elsewhere"


def test_invalid_manifests_are_refused(crd):
    good = pytorchjob.render(pytorchjob.JobSpec(name="j", image="i", train_args=[]))
    bad = json.loads(json.dumps(good))
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] = "Sometimes"
    bad["spec"]["runPolicy"]["unknownField"] = 1
    with pytest.raises(ValueError) as e:
        pytorchjob.validate(bad, crd)
    for message in ("exactly 1 replica", "no container named 'pytorch'", "restartPolicy must be", "unknownField"):
        assert message in str(e.value)


def test_local_launcher_trains_from_a_rendered_manifest(tmp_path):
    data, train, job_file = tmp_path / "data", tmp_path / "train", tmp_path / "job.yaml"
    hstu(["prepare", "--dataset", "synthetic", "--synthetic-users", "30", "--out", str(data)])
    hstu(["manifest", "--data-dir", str(data), "--out-dir", str(train), "--nodes", "2", "--epochs", "1",
          "--train-args", TINY + " --accelerator cpu", "-o", str(job_file)])
    hstu(["launch", str(job_file)])
    manifest = read_manifest(train / "model" / "embeddings")
    assert manifest["world_size"] == 2 and manifest["total_rows"] > 0


def test_local_launcher_runs_an_elastic_job_through_its_rendezvous(tmp_path):
    data, train, job_file = tmp_path / "data", tmp_path / "train", tmp_path / "job.yaml"
    hstu(["prepare", "--dataset", "synthetic", "--synthetic-users", "30", "--out", str(data)])
    hstu(["manifest", "--data-dir", str(data), "--out-dir", str(train), "--nodes", "2", "--elastic", "1:2", "--epochs", "1",
          "--train-args", TINY + " --accelerator cpu", "-o", str(job_file)])
    hstu(["launch", str(job_file)])
    assert read_manifest(train / "model" / "embeddings")["world_size"] == 2  # both Workers joined


@pytest.fixture(scope="module")
def trainer_crds(shared_dir):
    names = ("trainer.kubeflow.org_trainjobs.yaml", "trainer.kubeflow.org_clustertrainingruntimes.yaml")
    return [shared_dir / "schemas" / n for n in names]


def test_trainjob_and_its_runtime_validate_and_train_locally(tmp_path, trainer_crds):
    data, train, job_file = tmp_path / "data", tmp_path / "train", tmp_path / "job.yaml"
    hstu(["prepare", "--dataset", "synthetic", "--synthetic-users", "30", "--out", str(data)])
    schemas = [a for f in trainer_crds for a in ("--schema", str(f))]
    hstu(["manifest", "--api", "trainjob", "--data-dir", str(data), "--out-dir", str(train), "--nodes", "2", "--epochs", "1",
          "--train-args", TINY + " --accelerator cpu", *schemas, "-o", str(job_file)])
    runtime, job = yaml.safe_load_all(job_file.read_text())
    assert (runtime["kind"], job["kind"]) == ("ClusterTrainingRuntime", "TrainJob")
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"] == trainjob.RUNTIME_NAME
    assert job["spec"]["trainer"]["numNodes"] == 2 and job["spec"]["trainer"]["numProcPerNode"] == 1
    node = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert node["containers"][0]["name"] == "node" and node["securityContext"]["runAsNonRoot"]
    envs = trainjob.node_envs(job, master_port=29400)
    assert [e["PET_NODE_RANK"] for _, e in envs] == ["0", "1"] and {e["PET_NNODES"] for _, e in envs} == {"2"}
    hstu(["launch", str(job_file)])  # the nodes as local processes, with the torch plugin's environment
    assert read_manifest(train / "model" / "embeddings")["world_size"] == 2

    crds = [yaml.safe_load(f.read_text()) for f in trainer_crds]
    bad = json.loads(json.dumps(job))
    bad["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "3"})
    bad["spec"]["trainer"]["numNodes"] = "two"
    with pytest.raises(ValueError) as e:
        trainjob.validate(bad, runtime, *crds)
    assert "reserved variables: ['PET_NNODES']" in str(e.value) and "numNodes" in str(e.value)
    with pytest.raises(SystemExit, match="no elastic policy"):
        hstu(["manifest", "--api", "trainjob", "--data-dir", "/d", "--out-dir", "/o", "--elastic", "1:2"])


def test_trainjob_submit_creates_the_runtime_once_and_waits_for_completion():
    class NotFound(Exception):
        status = 404

    class FakeApi:
        def __init__(self):
            self.calls, self.polls = [], 0

        def get_cluster_custom_object(self, *args):
            raise NotFound()

        def create_cluster_custom_object(self, *args):
            self.calls.append(("runtime", args[2]))

        def create_namespaced_custom_object(self, *args):
            self.calls.append(("job", args[2], args[3]))

        def get_namespaced_custom_object(self, *args):
            self.polls += 1
            done = [{"type": "Complete", "status": "True"}] if self.polls > 1 else []
            return {"status": {"conditions": done}}

    spec = pytorchjob.JobSpec(name="j", image="i", train_args=["--epochs", "1"], namespace="ml")
    api = FakeApi()
    trainjob.submit(trainjob.render(spec), trainjob.render_runtime(spec), api=api, poll_s=0)
    assert api.calls == [("runtime", "clustertrainingruntimes"), ("job", "ml", "trainjobs")] and api.polls == 2


KUBERNETES_VERSION = "1.32"  # the schemas the core objects are held to (Debian's kubectl)


def test_kustomize_trees_build_with_the_rendered_jobs(crd, trainer_crds):
    """`kubectl kustomize` of every tree: each holds the platform (MLflow on PostgreSQL) and
    its job, the overlays patch the PyTorchJob or MLflow's artifact store, the
    cluster-scoped runtime gets no namespace, and every object validates: the custom ones
    against their CRDs, the core ones against Kubernetes' own schemas."""
    import shutil
    import subprocess

    import kubernetes_validate

    if not shutil.which("kubectl"):
        pytest.skip("kubectl is not installed (.ci/run installs it)")
    manifests = Path(__file__).parents[1] / "manifests"

    def build(tree: str) -> dict:
        out = subprocess.run(["kubectl", "kustomize", str(manifests / tree)], check=True, capture_output=True, text=True).stdout
        return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}

    trees = {t: build(t) for t in ("base", "overlays/cpu", "overlays/gpu", "overlays/s3-artifacts", "trainer-v2", "serving")}
    base, gpu, s3, v2 = trees["base"], trees["overlays/gpu"], trees["overlays/s3-artifacts"], trees["trainer-v2"]
    platform = {k for k in base if k[0] != "PyTorchJob"}
    assert {k for k in v2 if k[0] not in ("ClusterTrainingRuntime", "TrainJob")} == platform
    assert {("StatefulSet", "mlflow-postgres"), ("Secret", "mlflow-db"), ("Deployment", "mlflow")} <= platform
    job = base[("PyTorchJob", "hstu-train")]
    assert job["spec"] == yaml.safe_load((manifests / "base" / "pytorchjob.yaml").read_text())["spec"]
    assert gpu[("PyTorchJob", "hstu-train")]["spec"]["nprocPerNode"] == "8"
    worker = gpu[("PyTorchJob", "hstu-train")]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8" and worker["volumes"][0]["name"] == "dshm"
    assert "namespace" not in v2[("ClusterTrainingRuntime", "hstu-torch-distributed")]["metadata"]
    assert v2[("TrainJob", "hstu-train")]["metadata"]["namespace"] == "hstu"

    # MLflow: runs in PostgreSQL, artifacts on the server's volume (or in S3), probes, non-root
    mlflow_pod = base[("Deployment", "mlflow")]["spec"]["template"]["spec"]
    server = mlflow_pod["containers"][0]
    assert any(a.startswith("postgresql+psycopg://$(DB_USER):$(DB_PASSWORD)@mlflow-postgres:5432/") for a in server["args"])
    assert server["args"][server["args"].index("--artifacts-destination") + 1] == "/data/artifacts"
    assert server["readinessProbe"]["httpGet"]["path"] == "/health"
    postgres = base[("StatefulSet", "mlflow-postgres")]["spec"]["template"]["spec"]
    assert "pg_isready" in postgres["containers"][0]["readinessProbe"]["exec"]["command"][-1]
    for pod in (mlflow_pod, postgres):
        assert pod["securityContext"]["runAsNonRoot"] and pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"]
    s3_server = s3[("Deployment", "mlflow")]["spec"]["template"]["spec"]["containers"][0]
    assert s3_server["args"][s3_server["args"].index("--artifacts-destination") + 1].startswith("s3://")
    assert ("PersistentVolumeClaim", "mlflow-data") not in s3 and not s3_server.get("volumeMounts", [{}])[0].get("mountPath") == "/data"

    # the model server: `hstu serve` of an export on the workspace volume, probed, non-root
    serve = trees["serving"][("Deployment", "hstu-serve")]["spec"]["template"]["spec"]
    container = serve["containers"][0]
    assert container["command"] == ["hstu", "serve"] and "--export" in container["args"]
    assert {p: container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {
        "startupProbe": "/health", "readinessProbe": "/health", "livenessProbe": "/health"}
    assert serve["securityContext"]["runAsNonRoot"] and container["securityContext"]["readOnlyRootFilesystem"]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in serve["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"hstu-work"} and ("PersistentVolumeClaim", "hstu-work") in platform
    assert trees["serving"][("Service", "hstu-serve")]["spec"]["ports"][0]["targetPort"] == 8080

    for name, tree in trees.items():
        for (kind, _), obj in tree.items():
            if kind == "PyTorchJob":
                pytorchjob.validate(obj, crd)
            elif kind not in ("ClusterTrainingRuntime", "TrainJob"):  # unknown fields refused
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    trainjob.validate(v2[("TrainJob", "hstu-train")], v2[("ClusterTrainingRuntime", "hstu-torch-distributed")],
                      *(yaml.safe_load(f.read_text()) for f in trainer_crds))


def test_submit_creates_the_job_and_waits():
    calls = []

    class FakeCustomApi:
        def create_namespaced_custom_object(self, *args):
            calls.append(("create", args))

    class FakeClient:
        custom_api = FakeCustomApi()

        def wait_for_job_conditions(self, **kw):
            calls.append(("wait", kw))

    job = pytorchjob.render(pytorchjob.JobSpec(name="j", image="i", train_args=["--epochs", "1"], namespace="ml"))
    pytorchjob.submit(job, client=FakeClient())
    assert calls[0] == ("create", ("kubeflow.org", "v1", "ml", "pytorchjobs", job))
    assert calls[1][1]["name"] == "j" and calls[1][1]["job_kind"] == "PyTorchJob"


def rendering_command(path: Path) -> list[str]:
    """The `hstu manifest` arguments in a checked-in manifest's header comment."""
    header = [line for line in path.read_text().splitlines() if line.startswith("#") and "(" not in line]
    return " ".join(line.lstrip("# ").rstrip("\\ ") for line in header).split("hstu manifest", 1)[1].split()


def test_checked_in_manifests_are_what_the_cli_renders(tmp_path, crd, trainer_crds):
    manifests = Path(__file__).parents[1] / "manifests"
    base = manifests / "base" / "pytorchjob.yaml"
    hstu(["manifest", *rendering_command(base), "-o", str(tmp_path / "job.yaml")])
    assert yaml.safe_load(base.read_text()) == yaml.safe_load((tmp_path / "job.yaml").read_text())
    pytorchjob.validate(yaml.safe_load(base.read_text()), crd)

    runtime_file, job_file = manifests / "trainer-v2" / "clustertrainingruntime.yaml", manifests / "trainer-v2" / "trainjob.yaml"
    assert rendering_command(runtime_file) == rendering_command(job_file)
    hstu(["manifest", *rendering_command(job_file), "-o", str(tmp_path / "trainjob.yaml")])
    runtime, job = yaml.safe_load_all((tmp_path / "trainjob.yaml").read_text())
    assert yaml.safe_load(runtime_file.read_text()) == runtime and yaml.safe_load(job_file.read_text()) == job
    trainjob.validate(job, runtime, *(yaml.safe_load(f.read_text()) for f in trainer_crds))


def test_the_registered_model_serves_with_mlflow_models_serve(pipeline_run, tmp_path):
    """MLflow's own scoring server answers with the registered model (its signature
    enforced): the same top k as the export."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    from conftest import free_port

    results = json.loads((pipeline_run / "metrics.json").read_text())
    # the server execs `uvicorn` from PATH: this interpreter's, as an activated environment
    # has it (the pipeline run puts it there too, but in whichever test process ran it)
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    env = dict(os.environ, MLFLOW_TRACKING_URI=results["tracking_uri"], PATH=path)
    log = tmp_path / "models-serve.log"

    def start() -> tuple[subprocess.Popen, int]:
        port = free_port()
        with open(log, "w") as out:
            return subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/hstu/1", "--env-manager",
                                     "local", "-h", "127.0.0.1", "-p", str(port)], env=env, stdout=out, stderr=out), port

    server, port = start()
    try:
        deadline, tries = time.monotonic() + 120, 1
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)
                break
            except OSError:
                if server.poll() is not None and "address already in use" in log.read_text().lower() and tries < 3:
                    server, port = start()  # another process took the free port first
                    tries += 1
                    continue
                assert server.poll() is None and time.monotonic() < deadline, f"mlflow models serve did not start:\n{log.read_text()[-3000:]}"
                time.sleep(0.5)
        rec = Recommender.load(pipeline_run / "export")
        history = rec.item_ids[:4].tolist()
        times = [10, 20, 4000, 90000]
        for columns, rows, want in (
            (["history", "k"], [[history, 5]], [rec.recommend(history, k=5)]),
            (["history", "timestamps", "k"], [[history, times, 5], [history, None, 5]],
             [rec.recommend(history, times, k=5), rec.recommend(history, k=5)]),
        ):
            body = {"dataframe_split": {"columns": columns, "data": rows}}
            request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as r:
                predictions = json.loads(r.read())["predictions"]
            assert predictions == [[i for i, _ in top] for top in want]
    finally:
        server.terminate()
        server.wait(timeout=30)
