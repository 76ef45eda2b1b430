"""The pipeline's steps as plain functions: what each Kubeflow component calls.

Every step takes and returns directory paths on storage all steps share (a local work
directory, or a volume mounted in every pod), and logs into one MLflow run when given a
tracking URI and run id.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

from lightning_modules import datasets, export as export_lib, model_files
from lightning_modules.evaluate import HSTURanker, PopularityRanker, SASRecRanker, catalog_of, evaluate_rankers, whole_histories

from . import pytorchjob, tracking, trainjob


def _tracked(tracking_uri: str, run_id: str) -> bool:
    return bool(tracking_uri and run_id)


def prepare_step(
    dataset: str,
    out_dir: str,
    data_dir: str = "",
    input_file: str = "",
    seed: int = 0,
    synthetic_users: int = 6040,
    tracking_uri: str = "",
    run_id: str = "",
) -> str:
    stats = datasets.prepare(
        dataset, out_dir, data_dir=data_dir or None, input=input_file or None, seed=seed, synthetic_users=synthetic_users
    )
    print(json.dumps(stats, indent=2))
    if _tracked(tracking_uri, run_id):
        numeric = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        tracking.log_metrics(tracking_uri, run_id, numeric, prefix="data/")
        tracking.log_params(tracking_uri, run_id, {"dataset": dataset, "data_source": stats["source"]})
        tracking.log_artifact(tracking_uri, run_id, Path(out_dir) / "stats.json", "data")
        tracking.log_dataset(tracking_uri, run_id, out_dir, name=dataset)
    return out_dir


BASELINES = ("sasrec", "most-popular")  # what the model is compared with in metrics.json


def parse_baselines(baselines: str) -> list[str]:
    """A comma-separated list of BASELINES (empty: none)."""
    names = [b.strip() for b in baselines.split(",") if b.strip()]
    unknown = sorted(set(names) - set(BASELINES))
    if unknown:
        raise ValueError(f"unknown baselines {unknown}; choose from {', '.join(BASELINES)}")
    return names


# glibc malloc settings for training on CPUs: freed memory is kept for reuse instead of
# being returned to the system, and allocations below 32 MiB come from the heap, so that
# the large temporaries of every step (attention scores, logits) do not fault in fresh
# pages each time. The image sets the same.
CPU_MALLOC_TUNING = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


def train_args(
    data_dir: str, out_dir: str, preset: str, epochs: int, tracking_uri: str, run_id: str, extra: list[str] | None = None,
    patience: int = -1, model: str = "hstu", seed: int = 0,
) -> list[str]:
    """Arguments of `python -m lightning_modules.train`, shared by local and cluster runs
    (patience < 0: train all epochs)."""
    args = ["--data-dir", data_dir, "--out-dir", out_dir, "--model", model, "--preset", preset, "--epochs", str(epochs),
            "--seed", str(seed)]
    if patience >= 0:
        args += ["--patience", str(patience)]
    if tracking_uri:  # without a run id the workers start a run of their own
        args += ["--tracking-uri", tracking_uri] + (["--run-id", run_id] if run_id else [])
    return args + list(extra or [])


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    """A local torchrun of the training worker on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", pytorchjob.TRAIN_MODULE, *args]


def train_step(
    data_dir: str,
    out_dir: str,
    workers: int = 1,
    preset: str = "hstu",
    epochs: int = 1,
    extra_args: str = "",
    tracking_uri: str = "",
    run_id: str = "",
    launcher: str = "local",
    job_spec: str = "",
    patience: int = -1,
    model: str = "hstu",
    seed: int = 0,
) -> str:
    """Trains `model` with `workers` processes: local torchrun (launcher "local"), or a
    PyTorchJob ("pytorchjob") or a Trainer v2 TrainJob ("trainjob") on the cluster
    (`job_spec`: JSON of components.pytorchjob.JobSpec fields, without train_args), for at most `epochs`, stopping after `patience` validations without
    improvement (< 0: never); `seed` seeds the training."""
    extra = extra_args.split() if extra_args else []
    args = train_args(data_dir, out_dir, preset, epochs, tracking_uri, run_id, extra + ["--no-progress-bar"], patience, model, seed)
    if _tracked(tracking_uri, run_id) and model == "hstu":
        tracking.log_params(tracking_uri, run_id, {
            "preset": preset, "epochs": epochs, "patience": patience, "seed": seed, "workers": workers, "train_extra_args": extra_args,
        })
    if launcher == "local":  # (a cluster's pods see the data where this process may not)
        datasets.check_prepared(data_dir)
        env = dict(
            os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers))),
            GLIBC_TUNABLES=os.environ.get("GLIBC_TUNABLES", CPU_MALLOC_TUNING),
        )
        subprocess.run(torchrun_command(workers, args), check=True, env=env)
    elif launcher in ("pytorchjob", "trainjob"):
        fields = json.loads(job_spec)
        if model != "hstu":  # a job of its own beside the model's
            fields["name"] = f"{fields.get('name', 'hstu-train')}-{model}"
        spec = pytorchjob.JobSpec(**fields, train_args=args)
        if launcher == "pytorchjob":
            job = pytorchjob.render(spec)
            if pytorchjob.operator_errors(job):
                raise ValueError("\n".join(pytorchjob.operator_errors(job)))
            pytorchjob.submit(job)
        else:  # Kubeflow Trainer v2: the runtime is created where the cluster lacks it
            runtime, job = trainjob.render_runtime(spec), trainjob.render(spec)
            if errors := trainjob.trainer_rule_errors(job, runtime):
                raise ValueError("\n".join(errors))
            trainjob.submit(job, runtime)
    else:
        raise ValueError(f"unknown launcher {launcher!r}: local, pytorchjob or trainjob")
    read = model_files.read_info if model == "hstu" else model_files.load_sasrec
    read(Path(out_dir) / "model")  # the workers committed a complete model
    return out_dir


def baselines_step(data_dir: str, out_dir: str, baselines: str = "most-popular", **training) -> str:
    """Trains the baselines that learn (SASRec, into <out_dir>/sasrec) on the same data,
    validation and early stopping as the model: `training` holds train_step's arguments
    (workers, epochs, patience, seed, ...). The others need no training. Each logs into an
    MLflow run of its own, a child of the pipeline's."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tracking_uri, run_id = training.pop("tracking_uri", ""), training.pop("run_id", "")
    for name in parse_baselines(baselines):
        if name != "sasrec":
            continue
        child = tracking.start_run(tracking_uri, run_name=name, parent_run_id=run_id) if _tracked(tracking_uri, run_id) else ""
        train_step(data_dir, str(Path(out_dir) / name), tracking_uri=tracking_uri if child else "", run_id=child, model=name, **training)
        if child:
            tracking.finish_run(tracking_uri, child)
    return out_dir


def dump_step(train_dir: str, out_dir: str, tracking_uri: str = "", run_id: str = "") -> str:
    """The trained model re-dumped as one verified, single-shard model directory (what
    evaluation and serving load), whatever world size trained it."""
    model, items, info = model_files.load_model(Path(train_dir) / "model")
    path = model_files.save(out_dir, model, items, metadata=info["metadata"])
    if _tracked(tracking_uri, run_id):
        rows = items.item_table.stats().size
        tracking.log_metrics(tracking_uri, run_id, {"embedding_rows": rows}, prefix="dump/", step=final_step(info))
    return str(path)


def evaluate_step(
    model_dir: str, data_dir: str, out_dir: str, tracking_uri: str = "", run_id: str = "", baselines: str = "most-popular",
    baselines_dir: str = "",
) -> str:
    """Full-ranking test metrics of the model and the baselines, on the same users →
    metrics.json: {"model": ..., "sasrec": ..., "most_popular": ...}. baselines: a
    comma-separated list of BASELINES; SASRec's trained model is <baselines_dir>/sasrec/model."""
    model, items, info = model_files.load_model(model_dir)
    catalog = catalog_of(data_dir)
    rankers = {"model": HSTURanker(model, items, catalog)}
    for name in parse_baselines(baselines):
        if name == "sasrec":
            sasrec, sasrec_catalog, _ = model_files.load_sasrec(Path(baselines_dir) / "sasrec" / "model")
            rankers["sasrec"] = SASRecRanker(sasrec, sasrec_catalog, catalog)
        elif name == "most-popular":
            rankers["most_popular"] = PopularityRanker(data_dir, catalog)
    results = evaluate_rankers(rankers, whole_histories(data_dir, "test"), catalog)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    if _tracked(tracking_uri, run_id):
        step = final_step(info)  # where the registered model finds its metrics (export_step)
        for name, metrics in results.items():
            prefix = "test/" if name == "model" else f"baseline/{name}/"
            tracking.log_metrics(tracking_uri, run_id, metrics, prefix=prefix, step=step)
        tracking.log_artifact(tracking_uri, run_id, out / "metrics.json", "evaluation")
        curve = tracking.plot_training_curve(tracking_uri, run_id, out / "training_curve.png")
        tracking.log_artifact(tracking_uri, run_id, curve, "evaluation")
    return str(out / "metrics.json")


def final_step(model_info: dict) -> int:
    """The trained model's last training step: the step of the run's final metrics."""
    return int(model_info["metadata"].get("global_step") or 0)


def export_step(model_dir: str, data_dir: str, metrics_file: str, out_dir: str, tracking_uri: str = "", run_id: str = "") -> str:
    """The versioned export, logged as an MLflow model and registered (when tracked)."""
    metrics = json.loads(Path(metrics_file).read_text())
    version = str(tracking.next_model_version(tracking_uri)) if _tracked(tracking_uri, run_id) else "0"
    path = export_lib.export(model_dir, data_dir, out_dir, model_version=version, metrics=metrics)
    if _tracked(tracking_uri, run_id):
        registered = tracking.register_export(tracking_uri, run_id, path, step=final_step(model_files.read_info(model_dir)))
        tracking.log_params(tracking_uri, run_id, {"registered_model_version": registered})
    return str(path)
