"""The pipeline: prepare_data → train (and train_baselines beside it) → dump → evaluate → export,
all logging into one MLflow run that the pipeline opens (when given a tracking URI) and
ends, FINISHED or FAILED, whatever happens."""
from kfp import compiler, dsl

from components import kfp_components

DEFAULT_IMAGE = "ghcr.io/hstu-project/hstu:0.1.0"
NAME = "hstu-train-evaluate-export"


def build(image: str = DEFAULT_IMAGE, pvc: str | None = None, mount_path: str = "/workspace"):
    """The pipeline function; on a cluster, `pvc` is mounted at `mount_path` in every step."""
    ops = kfp_components.build(image)

    def on_volume(task):
        if pvc:  # the same entry kfp-kubernetes' mount_pvc writes
            task.platform_config["kubernetes"] = {
                "pvcMount": [{"mountPath": mount_path, "constant": pvc, "pvcNameParameter": {"runtimeValue": {"constant": pvc}}}]
            }
        return task

    @dsl.pipeline(name=NAME, description="HSTU on dynamic embeddings: data prep, distributed training, dump, evaluation, export")
    def hstu_pipeline(
        work_dir: str,
        dataset: str = "synthetic",
        data_dir: str = "",
        input_file: str = "",
        seed: int = 0,
        synthetic_users: int = 6040,
        workers: int = 1,
        preset: str = "hstu",
        epochs: int = 1,
        patience: int = -1,
        baselines: str = "most-popular",
        extra_args: str = "",
        tracking_uri: str = "",
        run_id: str = "",
        launcher: str = "local",
        job_spec: str = "",
    ):
        # the MLflow run: opened first (or the caller's, run_id), ended whatever happens
        close = ops["close_run"](tracking_uri=tracking_uri, pipeline_run=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        close.set_caching_options(False)
        with dsl.ExitHandler(close, name="tracked"):
            opened = ops["open_run"](
                tracking_uri=tracking_uri, run_id=run_id, pipeline_run=dsl.PIPELINE_JOB_ID_PLACEHOLDER, work_dir=work_dir,
                dataset=dataset, workers=workers, preset=preset, epochs=epochs, patience=patience, seed=seed,
                baselines=baselines, extra_args=extra_args,
            )
            opened.set_caching_options(False)
            run = opened.output
            prep = on_volume(
                ops["prepare_data"](
                    dataset=dataset, work_dir=work_dir, data_dir=data_dir, input_file=input_file,
                    seed=seed, synthetic_users=synthetic_users, tracking_uri=tracking_uri, run_id=run,
                )
            )
            train = on_volume(
                ops["train"](
                    data_dir=prep.output, work_dir=work_dir, workers=workers, preset=preset, epochs=epochs, patience=patience,
                    seed=seed, extra_args=extra_args, tracking_uri=tracking_uri, run_id=run, launcher=launcher, job_spec=job_spec,
                )
            )
            train.set_caching_options(False)
            trained_baselines = on_volume(
                ops["train_baselines"](
                    data_dir=prep.output, work_dir=work_dir, baselines=baselines, workers=workers, epochs=epochs,
                    patience=patience, seed=seed, extra_args=extra_args, tracking_uri=tracking_uri, run_id=run,
                    launcher=launcher, job_spec=job_spec,
                )
            )
            trained_baselines.set_caching_options(False)
            dump = on_volume(ops["dump"](train_dir=train.output, work_dir=work_dir, tracking_uri=tracking_uri, run_id=run))
            evaluation = on_volume(
                ops["evaluate"](
                    model_dir=dump.output, data_dir=prep.output, baselines=baselines, baselines_dir=trained_baselines.output,
                    work_dir=work_dir, tracking_uri=tracking_uri, run_id=run,
                )
            )
            on_volume(
                ops["export"](
                    model_dir=dump.output, data_dir=prep.output, metrics_file=evaluation.output,
                    work_dir=work_dir, tracking_uri=tracking_uri, run_id=run,
                )
            )

    return hstu_pipeline


def compile_pipeline(path: str, image: str = DEFAULT_IMAGE, pvc: str | None = None, mount_path: str = "/workspace") -> str:
    compiler.Compiler().compile(pipeline_func=build(image, pvc, mount_path), package_path=path)
    return path
