"""Kubeflow Pipelines components, one per step (and two that open and close the MLflow run). Each is a lightweight component whose body
imports and calls the step function in `components.steps`; the image holds the project.

Paths are strings on storage every step shares: a work directory on this machine, or a
volume mounted at the same path in every pod of a cluster run.
"""
from kfp import dsl


def open_run(
    tracking_uri: str, run_id: str, pipeline_run: str, work_dir: str, dataset: str, workers: int, preset: str, epochs: int,
    patience: int, seed: int, baselines: str, extra_args: str,
) -> str:
    from components.tracking import open_pipeline_run

    params = {"dataset": dataset, "workers": workers, "epochs": epochs, "preset": preset, "seed": seed, "patience": patience,
              "baselines": baselines, "extra_args": extra_args, "work_dir": work_dir}
    return open_pipeline_run(tracking_uri, run_id, pipeline_run, f"{dataset}-{preset}", params)


def close_run(tracking_uri: str, pipeline_run: str, status: dsl.PipelineTaskFinalStatus):
    from components.tracking import close_pipeline_run

    close_pipeline_run(tracking_uri, pipeline_run, succeeded=status.state == "SUCCEEDED")


def prepare_data(
    dataset: str, work_dir: str, data_dir: str, input_file: str, seed: int, synthetic_users: int, tracking_uri: str, run_id: str
) -> str:
    import os

    from components.steps import prepare_step

    return prepare_step(dataset, os.path.join(work_dir, "data"), data_dir, input_file, seed, synthetic_users, tracking_uri, run_id)


def train(
    data_dir: str,
    work_dir: str,
    workers: int,
    preset: str,
    epochs: int,
    patience: int,
    seed: int,
    extra_args: str,
    tracking_uri: str,
    run_id: str,
    launcher: str,
    job_spec: str,
) -> str:
    import os

    from components.steps import train_step

    return train_step(
        data_dir, os.path.join(work_dir, "train"), workers, preset, epochs, extra_args, tracking_uri, run_id, launcher, job_spec,
        patience, seed=seed,
    )


def train_baselines(
    data_dir: str,
    work_dir: str,
    baselines: str,
    workers: int,
    epochs: int,
    patience: int,
    seed: int,
    extra_args: str,
    tracking_uri: str,
    run_id: str,
    launcher: str,
    job_spec: str,
) -> str:
    import os

    from components.steps import baselines_step

    return baselines_step(
        data_dir, os.path.join(work_dir, "baselines"), baselines, workers=workers, epochs=epochs, patience=patience, seed=seed,
        extra_args=extra_args, tracking_uri=tracking_uri, run_id=run_id, launcher=launcher, job_spec=job_spec,
    )


def dump(train_dir: str, work_dir: str, tracking_uri: str, run_id: str) -> str:
    import os

    from components.steps import dump_step

    return dump_step(train_dir, os.path.join(work_dir, "model"), tracking_uri, run_id)


def evaluate(model_dir: str, data_dir: str, baselines: str, baselines_dir: str, work_dir: str, tracking_uri: str, run_id: str) -> str:
    import os

    from components.steps import evaluate_step

    return evaluate_step(model_dir, data_dir, os.path.join(work_dir, "evaluation"), tracking_uri, run_id, baselines, baselines_dir)


def export(model_dir: str, data_dir: str, metrics_file: str, work_dir: str, tracking_uri: str, run_id: str) -> str:
    import os

    from components.steps import export_step

    return export_step(model_dir, data_dir, metrics_file, os.path.join(work_dir, "export"), tracking_uri, run_id)


STEPS = (open_run, prepare_data, train, train_baselines, dump, evaluate, export, close_run)


def build(image: str) -> dict:
    """The components for an image that has the project installed (kfp included)."""
    return {f.__name__: dsl.component(f, base_image=image, install_kfp_package=False) for f in STEPS}
