"""The `hstu` command line. Bad input (a malformed file, a corrupt dump, a wrong value)
ends in `hstu: error: <what>` and exit status 1; `hstu --debug ...` shows the traceback."""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import yaml

from kernels.dynamic_embedding import DumpError
from lightning_modules.arguments import NON_NEGATIVE, NON_NEGATIVE_NUMBER, POSITIVE, at_least, item_ids, timestamps
from lightning_modules.config import PRESETS
from components.steps import BASELINES
from lightning_modules.datasets import DATASETS, DataError
from lightning_modules.serving import ServingConfig


def _add_data_source(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="synthetic", choices=DATASETS)
    p.add_argument("--data-dir", default="", help="folder holding a MovieLens zip or its extracted files (else: download)")
    p.add_argument("--input", default="", help="with --dataset csv: a CSV or Parquet of user_id,item_id,timestamp[,rating]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--synthetic-users", type=POSITIVE, default=6040)


# the training recipe's defaults: validate after every epoch, keep the best, stop once
# validation has not improved for PATIENCE epochs, or after EPOCHS
EPOCHS, PATIENCE = 200, 20


def _add_training(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=POSITIVE, default=1, help="training processes (torchrun)")
    p.add_argument("--epochs", type=POSITIVE, default=EPOCHS, help="the most epochs to train")
    p.add_argument("--patience", type=at_least(-1), default=PATIENCE,
                   help="stop once validation has not improved for this many epochs (-1: train every epoch)")
    p.add_argument("--preset", default="hstu", choices=sorted(PRESETS))
    p.add_argument("--train-args", default="", help="extra flags for the training worker, e.g. '--batch-size 64'")


def _add_job(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default="hstu-train")
    p.add_argument("--namespace", default="default")
    p.add_argument("--image", default=None, help="the project's image")
    p.add_argument("--nodes", type=POSITIVE, default=2, help="pods: one Master plus nodes - 1 Workers")
    p.add_argument("--gpus", type=NON_NEGATIVE, default=0, help="GPUs per pod")
    p.add_argument("--nproc-per-node", type=POSITIVE, default=None, help="training processes per pod (default: one per GPU, or 1)")
    p.add_argument("--cpu", default=None, help="CPU per pod (default: 8 per GPU, or 2)")
    p.add_argument("--memory", default=None, help="memory per pod (default: 64Gi per GPU, or 8Gi)")
    p.add_argument("--shm-size", default="4Gi", help="memory-backed /dev/shm per pod (NCCL, data loader workers)")
    p.add_argument("--elastic", default=None, metavar="MIN:MAX",
                   help="an elastic job of --nodes Worker pods that may run with MIN to MAX of them (c10d rendezvous)")
    p.add_argument("--max-restarts", type=NON_NEGATIVE, default=3, help="with --elastic: restarts of the workers' group")
    p.add_argument("--pvc", default=None, help="shared volume claim mounted at --mount-path (else an emptyDir)")
    p.add_argument("--mount-path", default="/workspace")
    p.add_argument("--compile-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="with --pvc: torch.compile's and Triton's caches and Triton's autotuning choices on it, shared by "
                        "every pod and later job (components.pytorchjob.COMPILE_CACHE)")


def _elastic(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        low, high = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--elastic {text!r}: expected MIN:MAX, two integers") from None
    return low, high


SERVING = ServingConfig()  # hstu serve's defaults


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hstu", description="HSTU recommenders on dynamic embeddings, as a Kubeflow pipeline")
    parser.add_argument("--debug", action="store_true", help="show an error's traceback, not only its message")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="the whole pipeline on this machine (Kubeflow local runner, MLflow on SQLite)")
    _add_data_source(p)
    _add_training(p)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--tracking-uri", default="", help="MLflow server; default sqlite:///<work-dir>/mlflow.db")
    p.add_argument("--baselines", default=",".join(BASELINES),
                   help=f"comma-separated, trained and evaluated beside the model: {', '.join(BASELINES)} (empty: none)")

    p = sub.add_parser("prepare", help="raw interactions → sequences + leave-one-out split")
    _add_data_source(p)
    p.add_argument("--out", required=True)

    p = sub.add_parser("train", help="train with local worker processes")
    p.add_argument("--data-dir", required=True, help="output of `hstu prepare`")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="hstu", choices=("hstu", "sasrec"), help="HSTU, or the SASRec baseline")
    p.add_argument("--seed", type=int, default=0, help="seeds the training")
    _add_training(p)

    p = sub.add_parser("dump", help="a trained model as one verified single-shard model directory")
    p.add_argument("--train-dir", required=True)
    p.add_argument("--out", required=True)

    p = sub.add_parser("evaluate", help="full-ranking HR/NDCG/MRR of the model and the baselines")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--baselines", default="most-popular", help=f"comma-separated: {', '.join(BASELINES)}")
    p.add_argument("--baselines-dir", default="", help="holds sasrec/model when sasrec is asked for")

    p = sub.add_parser("export", help="the versioned serving artifact")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--metrics", required=True, help="metrics.json from `hstu evaluate`")
    p.add_argument("--out", required=True)

    p = sub.add_parser("recommend", help="top-k items after a history, from an export")
    p.add_argument("--export", required=True)
    p.add_argument("--history", required=True, type=item_ids, help="comma-separated item ids, oldest first")
    p.add_argument("--timestamps", type=timestamps, default=None,
                   help="comma-separated times of the history's items, in the training data's unit (default: all 0)")
    p.add_argument("-k", type=POSITIVE, default=10)

    p = sub.add_parser("serve", help="an export online over HTTP: recommend, score, health, metrics, updates, snapshots")
    p.add_argument("--export", required=True, help="the export directory to serve first")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=NON_NEGATIVE, default=8080)
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--device-rows", type=POSITIVE, default=SERVING.device_rows, help="item rows cached on the device")
    p.add_argument("--host-rows", type=NON_NEGATIVE, default=SERVING.host_rows, help="item rows cached in host memory (0: none)")
    p.add_argument("--missing", default=SERVING.missing, choices=["initial", "zeros"],
                   help="the row of an id no tier holds: its training-time initial row, or zeros")
    p.add_argument("--work-dir", default="serve-work", help="where each version's disk store is built")
    p.add_argument("--max-batch", type=POSITIVE, default=64, help="requests per device batch at most")
    p.add_argument("--max-wait-ms", type=NON_NEGATIVE_NUMBER, default=2.0, help="how long a request waits for others to batch with")

    p = sub.add_parser("compile", help="the pipeline as Kubeflow IR YAML")
    p.add_argument("--out", required=True)
    p.add_argument("--image", default=None)
    p.add_argument("--pvc", default=None, help="volume claim mounted in every step")
    p.add_argument("--mount-path", default="/workspace")

    p = sub.add_parser("manifest", help="render the training job: a PyTorchJob, or a Trainer v2 TrainJob and its runtime")
    p.add_argument("--api", default="pytorchjob", choices=("pytorchjob", "trainjob"),
                   help="Training Operator v1 PyTorchJob, or Kubeflow Trainer v2 TrainJob + ClusterTrainingRuntime")
    _add_job(p)
    _add_training(p)
    p.add_argument("--data-dir", required=True, help="prepared data, as the pods see it")
    p.add_argument("--out-dir", required=True, help="training output, as the pods see it")
    p.add_argument("--tracking-uri", default="")
    p.add_argument("--run-id", default="")
    p.add_argument("--schema", action="append", default=[],
                   help="a CRD YAML to validate against (PyTorchJob; or, repeated, TrainJob and ClusterTrainingRuntime)")
    p.add_argument("-o", "--output", default="-")

    p = sub.add_parser("submit", help="compile the pipeline, upload it to Kubeflow Pipelines and start a run")
    p.add_argument("--host", required=True, help="the Kubeflow Pipelines endpoint (token from $KFP_TOKEN)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a pipeline parameter, repeated (work_dir=/workspace/run1 dataset=ml-1m launcher=trainjob ...)")
    p.add_argument("--namespace", default="kubeflow")
    p.add_argument("--experiment", default="hstu")
    p.add_argument("--run-name", default=None)
    p.add_argument("--pipeline-name", default=None, help="the uploaded pipeline's name (a new version where it exists)")
    p.add_argument("--image", default=None)
    p.add_argument("--pvc", default=None, help="volume claim mounted in every step")
    p.add_argument("--mount-path", default="/workspace")
    p.add_argument("--wait", action="store_true", help="wait for the run to end; exit 1 unless it succeeded")
    p.add_argument("--timeout", type=POSITIVE, default=7 * 24 * 3600, help="with --wait: seconds")

    p = sub.add_parser("launch", help="run a PyTorchJob's replicas, or a TrainJob's nodes, as local processes")
    p.add_argument("manifest")
    return parser


# errors that describe bad input (a file, a dump, a flag's value): printed as a message
USER_ERRORS = (DataError, DumpError, OSError, ValueError, subprocess.CalledProcessError, yaml.YAMLError)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except USER_ERRORS as e:
        if args.debug:
            raise
        parser.exit(1, f"hstu: error: {e}\n")


def _run(args) -> int:
    if args.command == "run":
        from .local import run_local

        results = run_local(
            args.work_dir, args.dataset, args.data_dir, args.input, args.workers, args.epochs, args.preset,
            args.train_args, args.patience, args.baselines, args.tracking_uri, args.seed, args.synthetic_users,
        )
        _print_results(results, Path(args.work_dir) / "metrics.json")
    elif args.command == "prepare":
        from components.steps import prepare_step

        prepare_step(args.dataset, args.out, args.data_dir, args.input, args.seed, args.synthetic_users)
    elif args.command == "train":
        from components.steps import train_step

        train_step(
            args.data_dir, args.out, args.workers, args.preset, args.epochs, args.train_args, patience=args.patience,
            model=args.model, seed=args.seed,
        )
    elif args.command == "dump":
        from components.steps import dump_step

        print(dump_step(args.train_dir, args.out))
    elif args.command == "evaluate":
        from components.steps import evaluate_step

        evaluate_step(args.model_dir, args.data_dir, args.out, baselines=args.baselines, baselines_dir=args.baselines_dir)
    elif args.command == "export":
        from components.steps import export_step

        print(export_step(args.model_dir, args.data_dir, args.metrics, args.out))
    elif args.command == "serve":
        import torch

        from .serve import serve

        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        config = ServingConfig(device_rows=args.device_rows, host_rows=args.host_rows, missing=args.missing)
        serve(args.export, args.host, args.port, config=config, device=device, work_dir=args.work_dir,
              max_batch=args.max_batch, max_wait_ms=args.max_wait_ms)
    elif args.command == "recommend":
        from lightning_modules.export import Recommender

        for item, score in Recommender.load(args.export).recommend(args.history, args.timestamps, k=args.k):
            print(f"{item}\t{score:.4f}")
    elif args.command == "compile":
        from .pipeline import DEFAULT_IMAGE, compile_pipeline

        print(compile_pipeline(args.out, args.image or DEFAULT_IMAGE, args.pvc, args.mount_path))
    elif args.command == "manifest":
        _manifest(args)
    elif args.command == "submit":
        return _submit(args)
    elif args.command == "launch":
        from .launcher import launch

        launch(*(d for d in yaml.safe_load_all(Path(args.manifest).read_text()) if d))
    return 0


def _submit(args) -> int:
    from . import submit as kfp_submit
    from .pipeline import DEFAULT_IMAGE, NAME

    s = kfp_submit.Submission(
        host=args.host, parameters=kfp_submit.parse_parameters(args.param), namespace=args.namespace,
        experiment=args.experiment, run_name=args.run_name, pipeline_name=args.pipeline_name or NAME,
        image=args.image or DEFAULT_IMAGE, pvc=args.pvc, mount_path=args.mount_path,
    )
    import kfp

    client = kfp.Client(host=s.host, namespace=s.namespace, existing_token=os.environ.get(kfp_submit.TOKEN_ENV))
    done = kfp_submit.submit(s, client)
    print(f"run {done.run_id}: {done.url}", flush=True)
    if not args.wait:
        return 0
    state = kfp_submit.wait(client, done.run_id, args.timeout)
    print(f"run {done.run_id}: {state}")
    return 0 if state == kfp_submit.SUCCEEDED else 1


def _manifest(args) -> None:
    from components import pytorchjob, trainjob
    from components.steps import train_args

    from .pipeline import DEFAULT_IMAGE

    spec = pytorchjob.JobSpec(
        name=args.name, namespace=args.namespace, image=args.image or DEFAULT_IMAGE,
        train_args=train_args(
            args.data_dir, args.out_dir, args.preset, args.epochs, args.tracking_uri, args.run_id,
            args.train_args.split() + ["--no-progress-bar"], args.patience,
        ),
        nodes=args.nodes, nproc_per_node=args.nproc_per_node, cpu=args.cpu, memory=args.memory,
        gpus=args.gpus, pvc=args.pvc, mount_path=args.mount_path, shm_size=args.shm_size, compile_cache=args.compile_cache,
        elastic=_elastic(args.elastic), max_restarts=args.max_restarts,
    )
    crds = {c["spec"]["names"]["kind"]: c for c in (yaml.safe_load(Path(f).read_text()) for f in args.schema)}
    try:
        if args.api == "trainjob":
            docs = [trainjob.render_runtime(spec), trainjob.render(spec)]
            if crds:
                trainjob.validate(docs[1], docs[0], crds["TrainJob"], crds["ClusterTrainingRuntime"])
            elif errors := trainjob.trainer_rule_errors(docs[1], docs[0]):
                raise ValueError("\n".join(errors))
        else:
            docs = [pytorchjob.render(spec)]
            if crds:
                pytorchjob.validate(docs[0], crds["PyTorchJob"])
            elif errors := pytorchjob.operator_errors(docs[0]):
                raise ValueError("\n".join(errors))
    except KeyError as e:
        raise SystemExit(f"hstu manifest --api {args.api}: no --schema for {e}") from None
    except ValueError as e:
        raise SystemExit(f"hstu manifest: {e}") from None
    text = yaml.safe_dump_all(docs, sort_keys=False)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)


def _print_results(results: dict, path: Path) -> None:
    rankers = [n for n in ("model", "sasrec", "most_popular") if n in results]
    print(f"\n{'metric':<10}" + "".join(f"{n.replace('_', '-'):>14}" for n in rankers))
    for k in ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "hr@200", "ndcg@200", "mrr"):
        print(f"{k:<10}" + "".join(f"{results[n][k]:>14.4f}" for n in rankers))
    print(f"\n{results['model']['users']} users, seed {results['seed']}")
    print(f"metrics: {path}\nMLflow run {results['run_id']} at {results['tracking_uri']}")


if __name__ == "__main__":
    sys.exit(main())
