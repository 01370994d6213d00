"""One SageMaker training job per stage, as an SDK-free definition (`JobSpec`).

`job_spec`: the image by digest, role, instances, one S3Prefix channel per upstream artifact, output,
checkpoint and TensorBoard URIs, metric definitions, spot, limits, VPC, environment and tags. The SDK backend
and `--backend sagemaker-local` both run it, so what runs locally is what is submitted. `offline_jobs` plans
without reading S3 (the dry run)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dilforge_shared.configs import ModelConfig, PipelineConfig
from dilforge_shared.configs.cloud import SageMakerConfig, StageResources
from dilforge_shared.errors import ConfigError, DilforgeError
from dilforge_shared.hyperparameters import build_hyperparameters
from dilforge_shared.identity import artifact_id as planned_artifact_id
from dilforge_shared.manifest import InputRef
from dilforge_shared.recipes import source_kind

from ..pipeline import StageJob, module_env

HYPERPARAMETER_LIMIT = 2500


MULTI_HOST_STAGES = {"cpt"}


BASE_NAME_LIMIT = 48  # the SDK appends -YYYYMMDDHHMMSS; SageMaker names are at most 63 characters


NUM = r"([-+]?(?:[0-9]*\.)?[0-9]+(?:[eE][-+]?[0-9]+)?)"


# SageMaker reads the job's stdout/stderr with these (first capture group = the value).
# cpt: its Metrics.record lines `step=10 phase=2 loss=2.31 lr=0.0003 grad_norm=0.9 tokens_per_s=...`
#      and validation lines `step=10 val_loss=2.4 val_bpb=1.1`;
# sft: transformers' PrinterCallback dicts `{'loss': '2.31', 'grad_norm': '0.9', 'learning_rate': ...}`
#      and `validation loss after: 1.2345`;
# eval: `bpb <model> / <set>: 1.2345 (...)`; tokenizer: `sweep (selected 32000)`.
METRIC_DEFINITIONS: dict[str, list[dict[str, str]]] = {
    "tokenizer": [
        {"Name": "tokenizer:selected_vocab_size", "Regex": r"sweep \(selected ([0-9]+)\)"},
    ],
    "cpt": [
        {"Name": "train:loss", "Regex": rf"\bphase=[0-9]+ loss={NUM}"},
        {"Name": "train:lr", "Regex": rf"\blr={NUM}"},
        {"Name": "train:grad_norm", "Regex": rf"\bgrad_norm={NUM}"},
        {"Name": "train:tokens_per_s", "Regex": rf"\btokens_per_s={NUM}"},
        {"Name": "train:mfu", "Regex": rf"\bmfu={NUM}"},
        {"Name": "validation:loss", "Regex": rf"\bval_loss={NUM}"},
        {"Name": "validation:bpb", "Regex": rf"\bval_bpb={NUM}"},
    ],
    "sft": [
        {"Name": "train:loss", "Regex": rf"'loss': '?{NUM}"},
        {"Name": "train:lr", "Regex": rf"'learning_rate': '?{NUM}"},
        {"Name": "train:grad_norm", "Regex": rf"'grad_norm': '?{NUM}"},
        {"Name": "validation:loss", "Regex": rf"validation loss after: {NUM}"},
    ],
    "eval": [
        {"Name": "eval:bpb", "Regex": rf"\bbpb [^:]+: {NUM} \("},
    ],
}


def job_base_name(prefix: str, stage: str, artifact_id: str) -> str:
    """`<prefix>-<stage>-<artifact id>`, cut so the SDK's timestamp suffix keeps the name within 63 characters."""
    return f"{prefix}-{stage}-{artifact_id}"[:BASE_NAME_LIMIT].rstrip("-")


def offline_jobs(pipeline: PipelineConfig) -> list[StageJob]:
    """Plan every stage without reading S3: ids from config + input URIs (a real run's ids also hash digests)."""
    store = pipeline.store.uri.rstrip("/")
    planned: dict[str, str] = {}
    jobs = []
    for stage, config in pipeline.stages():
        inputs = {name: planned[name] for name in config.input_names() if name in planned}
        missing = [n for n in config.needed_inputs() if n not in inputs]
        if missing:
            raise DilforgeError(f"stage {stage} needs upstream artifacts {missing} in the same pipeline for a dry run")
        refs = [InputRef(name=n, kind="manifest", uri=u, sha256=f"offline:{u}") for n, u in sorted(inputs.items())]
        refs += [
            InputRef(name=f"data:{s.label}", kind="data", uri=s.uri, sha256=f"offline:{s.uri}")
            for s in config.file_sources()
        ]
        refs += [InputRef(name=f"model:{u}", kind="data", uri=u, sha256=f"offline:{u}") for u in config.model_uris()]
        if isinstance(config, ModelConfig):
            refs.append(InputRef(name="source", kind="data", uri=config.source, sha256=f"offline:{config.source}"))
        artifact_id = planned_artifact_id(config, refs)
        uri = f"{store}/artifacts/{stage}/{artifact_id}"
        planned[stage] = uri
        jobs.append(
            StageJob(
                stage=stage,
                config=config,
                run_id=pipeline.run_id,
                artifact_uri=uri,
                inputs=inputs,
                store_uri=store,
                s3_endpoint_url=pipeline.store.s3_endpoint_url,
            )
        )
    return jobs


def local_paths(job: StageJob) -> list[str]:
    """Data and model/tokenizer URIs a SageMaker job could not read: anything not on S3."""
    uris = [s.uri for s in job.config.file_sources()] + job.config.model_uris()
    if isinstance(job.config, ModelConfig) and source_kind(job.config.source) in ("folder", "gguf"):
        uris.append(job.config.source)  # a recipe is fetched by the job itself; a local folder is not reachable
    return [u for u in uris if not u.startswith("s3://")]


CHECKPOINT_PATH = "/opt/ml/checkpoints"


TENSORBOARD_PATH = "/opt/ml/output/tensorboard"


@dataclass(frozen=True)
class Machines:
    """What every SageMaker job of a stage names: who runs it, on what, for how long (training and processing)."""

    stage: str
    base_job_name: str
    image: str
    role_arn: str
    instance_type: str
    num_instances: int
    volume_size_gb: int
    max_runtime_s: int


@dataclass(frozen=True)
class JobSpec(Machines):
    """One stage's training job, SDK-free: everything `model_trainer` hands to ModelTrainer, cloud and local alike."""

    spot: bool
    max_wait_s: int | None
    input_mode: str
    channels: dict[str, str]  # channel name -> S3 prefix of the upstream artifact folder (with a trailing /)
    output_path: str
    checkpoint_uri: str
    tensorboard_uri: str
    environment: dict[str, str]
    hyperparameters: dict[str, str]
    tags: dict[str, str]
    metric_definitions: list[dict[str, str]]
    subnets: list[str] = field(default_factory=list)
    security_group_ids: list[str] = field(default_factory=list)
    max_retry_attempts: int = 0


def output_root(cfg: SageMakerConfig, job: StageJob) -> str:
    return (cfg.output_uri or f"{job.store_uri}/sagemaker").rstrip("/")


def checkpoint_uri(cfg: SageMakerConfig, job: StageJob) -> str:
    """The training job's checkpoint prefix, restored into /opt/ml/checkpoints of every host (with a trailing /)."""
    return f"{output_root(cfg, job)}/checkpoints/{job.stage}/{job.artifact_id}/"


def config_uri(cfg: SageMakerConfig, job: StageJob) -> str:
    """Where the stage config goes (hyperparameter values are limited to 2500 characters)."""
    return f"{output_root(cfg, job)}/configs/{job.stage}/{job.artifact_id}.json"


def require_s3_inputs(job: StageJob) -> None:
    """SageMaker jobs (training and processing) read their data and models from S3, never from this machine."""
    if bad := local_paths(job):
        raise ConfigError(
            f"{job.stage}: {bad} are local paths; SageMaker jobs read data and models from S3: "
            "upload them and use s3:// URIs in the config"
        )


def stage_hyperparameters(job: StageJob, cfg: SageMakerConfig, endpoint_url: str | None) -> dict[str, str]:
    """The stage's request as SageMaker passes it (a training job's hyperparameters, a processing job's
    hyperparameters.json); `endpoint_url` is the S3 endpoint as the job's containers reach it."""
    return build_hyperparameters(
        job.config, job.artifact_uri, job.run_id, job.inputs, endpoint_url, config_uri=config_uri(cfg, job)
    )


def job_environment(job: StageJob, image: str, res: StageResources, extra: dict[str, str]) -> dict[str, str]:
    """What every dilforge job's containers get, then `extra`, then the config's own (validated) entries."""
    env = {"DILFORGE_IMAGE": image, "DILFORGE_RUN_ID": job.run_id, "DILFORGE_LOG_LEVEL": "INFO", **extra}
    return {**env, **res.environment}


def job_tags(job: StageJob, cfg: SageMakerConfig, extra: dict[str, str] | None = None) -> dict[str, str]:
    tags = {"dilforge:run-id": job.run_id, "dilforge:stage": job.stage, "dilforge:artifact-id": job.artifact_id}
    return {**tags, **(extra or {}), **cfg.tags}


def job_spec(job: StageJob, cfg: SageMakerConfig, image: str, endpoint_url: str | None = None) -> JobSpec:
    """The job definition of one stage; `endpoint_url` is the S3 endpoint as the job's containers reach it."""
    require_s3_inputs(job)
    res = cfg.resources(job.stage)
    if res.num_instances > 1 and job.stage not in MULTI_HOST_STAGES:
        raise ConfigError(
            f"sagemaker.stages.{job.stage}.num_instances: {job.stage} runs on one host "
            f"(multi-host stages: {sorted(MULTI_HOST_STAGES)})"
        )
    hp = stage_hyperparameters(job, cfg, endpoint_url)
    for key, value in hp.items():
        if len(value) > HYPERPARAMETER_LIMIT:
            raise ConfigError(
                f"hyperparameter {key!r} of stage {job.stage} is {len(value)} characters; "
                f"SageMaker allows {HYPERPARAMETER_LIMIT}"
            )
    spot = cfg.spot if res.spot is None else res.spot
    root = output_root(cfg, job)
    return JobSpec(
        stage=job.stage,
        base_job_name=job_base_name(cfg.job_name_prefix, job.stage, job.artifact_id),
        image=image,
        role_arn=cfg.role_arn,
        instance_type=res.instance_type,
        num_instances=res.num_instances,
        volume_size_gb=res.volume_size_gb,
        spot=spot,
        max_runtime_s=res.max_runtime_s,
        max_wait_s=(res.max_wait_s or min(2 * res.max_runtime_s, 28 * 24 * 3600)) if spot else None,
        input_mode=res.input_mode,
        channels={n: u.rstrip("/") + "/" for n, u in sorted(job.inputs.items())},
        output_path=f"{root}/output/",
        checkpoint_uri=checkpoint_uri(cfg, job),
        tensorboard_uri=f"{root}/tensorboard/{job.stage}/{job.artifact_id}/",
        environment=job_environment(job, image, res, module_env(job.stage)),
        hyperparameters=hp,
        tags=job_tags(job, cfg),
        metric_definitions=METRIC_DEFINITIONS.get(job.stage, []),
        subnets=list(cfg.subnets),
        security_group_ids=list(cfg.security_group_ids),
        max_retry_attempts=cfg.max_retry_attempts,
    )


# ---- curate: SageMaker Processing jobs across instances --------------------------------------------

PROCESSING_ROOT = "/opt/ml/processing"
PROCESSING_OPT_ML = f"{PROCESSING_ROOT}/dilforge"  # the stage's /opt/ml root inside a processing container
CURATE_PHASES = ("filter", "buckets", "cluster", "write")
PROCESSING_STAGES = {"curate"}  # stages that run as SageMaker Processing jobs, not training jobs


@dataclass(frozen=True)
class ProcessingSpec(Machines):
    """One SageMaker Processing job (a curate phase, or CPT's token cache), SDK-free (`sagemaker_sdk.run_processor`
    submits it)."""

    phase: str
    entrypoint: list[str]
    inputs: dict[str, tuple[str, str]]  # input name -> (S3 prefix, container path)
    outputs: dict[str, tuple[str, str]]  # output name -> (container path, S3 prefix)
    environment: dict[str, str]
    tags: dict[str, str]


def processing_root(cfg: SageMakerConfig, job: StageJob) -> str:
    """The S3 prefix of one artifact's Processing jobs (`config/`, `work/`); removed once the artifact is published,
    kept after a failure so that a rerun resumes."""
    return f"{output_root(cfg, job)}/processing/{job.stage}/{job.artifact_id}"


def hyperparameters_uri(cfg: SageMakerConfig, job: StageJob) -> str:
    return f"{processing_root(cfg, job)}/config/hyperparameters.json"


def work_uri(cfg: SageMakerConfig, job: StageJob) -> str:
    return f"{processing_root(cfg, job)}/work/"


def processing_specs(job: StageJob, cfg: SageMakerConfig, image: str) -> list[ProcessingSpec]:
    """The curate stage on several instances: one Processing job per datatrove phase, then one that publishes.

    Each phase reads the earlier phases' outputs from one S3 prefix; the tasks and their documents do not depend on
    the instance count, so the output equals a one-machine run's. Hyperparameters, S3 endpoint included, are a
    file input."""
    require_s3_inputs(job)
    res = cfg.resources(job.stage)
    work = work_uri(cfg, job)
    hp_dir = hyperparameters_uri(cfg, job).rsplit("/", 1)[0] + "/"
    config_input = {"hyperparameters": (hp_dir, f"{PROCESSING_OPT_ML}/input/config")}
    env = job_environment(job, image, res, {"DILFORGE_OPT_ML": PROCESSING_OPT_ML})
    specs = []
    for i, phase in enumerate((*CURATE_PHASES, "publish")):
        entry = ["python3", "-m", "dilforge_curate", "process", phase, "--read", f"{PROCESSING_ROOT}/work"]
        inputs = dict(config_input)
        if i > 0:  # the union of every earlier phase's outputs, as one prefix
            inputs["work"] = (work, f"{PROCESSING_ROOT}/work")
        outputs = {}
        if phase != "publish":
            entry += ["--write", f"{PROCESSING_ROOT}/output"]
            outputs["work"] = (f"{PROCESSING_ROOT}/output", work)
        specs.append(
            ProcessingSpec(
                stage=job.stage,
                phase=phase,
                base_job_name=f"{job_base_name(cfg.job_name_prefix, job.stage, job.artifact_id)}-{phase}",
                image=image,
                role_arn=cfg.role_arn,
                instance_type=res.instance_type,
                num_instances=res.num_instances if phase in ("filter", "buckets", "write") else 1,
                volume_size_gb=res.volume_size_gb,
                max_runtime_s=res.max_runtime_s,
                entrypoint=entry,
                inputs=inputs,
                outputs=outputs,
                environment=env,
                tags=job_tags(job, cfg, {"dilforge:phase": phase}),
            )
        )
    return specs


# ---- cpt: the token cache as a Processing job before the training job ----------------------------


def token_cache_spec(job: StageJob, cfg: SageMakerConfig, image: str) -> ProcessingSpec | None:
    """CPT's token cache on one CPU instance (`sagemaker.stages.cpt.token_cache_instance_type`), or None when the
    training job tokenises: `python -m dilforge_cpt build-cache` in the stage's image, with the stage's
    hyperparameters file, on every core; its `checkpoints/tokens` goes to the training job's checkpoint prefix,
    which SageMaker restores into each training host's /opt/ml/checkpoints, where the stage reuses a finished
    cache (same key: corpus, tokenizer and endpoint) instead of tokenising."""
    res = cfg.resources(job.stage)
    if job.stage != "cpt" or res.token_cache_instance_type is None:
        return None
    require_s3_inputs(job)
    hp_dir = hyperparameters_uri(cfg, job).rsplit("/", 1)[0] + "/"
    return ProcessingSpec(
        stage=job.stage,
        phase="token-cache",
        base_job_name=f"{job_base_name(cfg.job_name_prefix, job.stage, job.artifact_id)}-token-cache",
        image=image,
        role_arn=cfg.role_arn,
        instance_type=res.token_cache_instance_type,
        num_instances=1,
        volume_size_gb=res.volume_size_gb,
        max_runtime_s=res.max_runtime_s,
        entrypoint=["python3", "-m", "dilforge_cpt", "build-cache"],
        inputs={"hyperparameters": (hp_dir, f"{PROCESSING_OPT_ML}/input/config")},
        outputs={"tokens": (f"{PROCESSING_OPT_ML}/checkpoints/tokens", f"{checkpoint_uri(cfg, job)}tokens/")},
        environment=job_environment(job, image, res, {"DILFORGE_OPT_ML": PROCESSING_OPT_ML}),
        tags=job_tags(job, cfg, {"dilforge:phase": "token-cache"}),
    )
