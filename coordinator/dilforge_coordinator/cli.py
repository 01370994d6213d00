"""`coordinator`: thin Typer commands that build a config and call a plain function."""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Annotated

import typer
from dilforge_shared.manifest import STAGES
from dilforge_shared.settings import cache_root
from dilforge_shared.store import NotFound, fetch, read_manifest
from typer.core import TyperGroup

from . import pipeline as pl
from .backends import BACKENDS
from .chat import chat_cmd
from .common import USER_ERRORS, EndpointOpt, StoreRootOpt, _prepared_backend, _setup_logging, fail, one_line
from .config import PipelineConfig, load_pipeline
from .deploy import deploy_cmd
from .images import images_app
from .leases import owner_alive
from .models_cmd import models_app
from .records import ArtifactStore
from .settings import coordinator_settings


class StopRequested(KeyboardInterrupt):
    """SIGTERM (or SIGINT) outside a running stage: unwinds like Ctrl-C, so the run record ends `cancelled`."""


def _stop(signum, frame) -> None:
    """Say so at once (typer turns the KeyboardInterrupt into a silent exit 130), then unwind."""
    name = signal.Signals(signum).name
    typer.echo(f"cancelled by {name}", err=True)
    raise StopRequested(f"cancelled by {name}")


class OneLineErrors(TyperGroup):
    """Whatever command runs (chat included): a user error, an OS error (full disk, a store path under a file) or
    an S3 answer is one line on stderr and exit 1; a cancelled stage, Ctrl-C or SIGTERM is exit 130, wherever it
    lands (planning, hashing, waiting for a lock; a running stage gets it forwarded); never a traceback."""

    def main(self, *args, **kwargs):
        main = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
        try:
            return super().main(*args, **kwargs)
        except KeyboardInterrupt as exc:
            typer.echo(f"{exc or 'cancelled (interrupted)'}", err=True)
            sys.exit(130)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except pl.StageCancelled as exc:
            fail(str(exc), 130)
        except USER_ERRORS as exc:
            fail(one_line(exc))


app = typer.Typer(
    cls=OneLineErrors,
    help="dilforge coordinator: run the model → tokenizer → cpt → sft → eval pipeline.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
manifest_app = typer.Typer(help="Inspect artifact manifests.", no_args_is_help=True)
app.add_typer(manifest_app, name="manifest")
app.add_typer(images_app, name="images")
app.add_typer(models_app, name="models")
app.command("chat")(chat_cmd)
if importlib.util.find_spec("dilforge_serve") is not None:  # the serve service; scripts/setup.sh installs it
    from .serve_cmd import export_cmd, serve_cmd

    app.command("serve")(serve_cmd)
    app.command("export")(export_cmd)
else:  # the coordinator image

    @app.command("serve", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @app.command("export", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def needs_the_serve_service() -> None:
        """Needs the serve service (services/serve)."""
        fail("this needs the serve service: pip install -e services/serve (scripts/setup.sh does)")


app.command("deploy")(deploy_cmd)

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="Pipeline YAML (see configs/).", exists=False)]
DataOpt = Annotated[
    Path | None,
    typer.Option("--data", help="Folder with the data the config refers to as ${DILFORGE_DATA} (e.g. ../shared/data)."),
]
BackendOpt = Annotated[str, typer.Option("--backend", "-b", help=f"Where stages run: {', '.join(BACKENDS)}.")]
StoreOpt = Annotated[str | None, typer.Option("--store", help="Override store.uri of the config.")]


DryRunHelp = "sagemaker backend: print every CreateTrainingJob request, offline, and submit nothing."
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help=DryRunHelp)]


def _load(config: Path, data: Path | None, store: str | None) -> PipelineConfig:
    """The pipeline config; `--data` is passed to interpolation as DILFORGE_DATA (os.environ is never written)."""
    variables = {"DILFORGE_DATA": str(data.resolve())} if data is not None else None
    return load_pipeline(config, {"store.uri": store} if store else None, variables)


def _print_dry_run(backend, cfg: PipelineConfig, stage: str | None = None) -> None:
    typer.echo(json.dumps(backend.dry_run_requests(cfg, stage), indent=2, default=str))


@app.command("validate")
def validate_cmd(config: ConfigOpt, data: DataOpt = None) -> None:
    """Validate a pipeline config (every stage) without running anything."""
    cfg = _load(config, data, None)
    typer.echo(f"{config}: valid; stages: {', '.join(name for name, _ in cfg.stages()) or 'none'}")


@app.command("run")
def run_cmd(
    stage: Annotated[str, typer.Argument(help=", ".join(STAGES))],
    config: ConfigOpt,
    data: DataOpt = None,
    backend: BackendOpt = "local",
    store: StoreOpt = None,
    inputs: Annotated[
        list[str] | None, typer.Option("--input", help="Upstream artifact NAME=URI; defaults to this run's record.")
    ] = None,
    dry_run: DryRunOpt = False,
    verbose: bool = False,
) -> None:
    """Run one stage of the pipeline config."""
    _setup_logging(verbose)
    if stage not in STAGES:
        fail(f"{stage!r} is not a stage; stages: {', '.join(STAGES)}")
    cfg = _load(config, data, store)
    if getattr(cfg, stage, None) is None:
        fail(f"{config}: no '{stage}' section; stages configured: {[n for n, _ in cfg.stages()]}")
    runner, cfg = _prepared_backend(backend, cfg, dry_run, data)
    if dry_run:
        return _print_dry_run(runner, cfg, stage)
    upstream = pl.upstream_from_record(cfg)
    for item in inputs or []:
        name, sep, uri = item.partition("=")
        if not sep or not name or not uri:
            fail(f"--input {item!r}: expected NAME=URI")
        pl.check_input_names(stage, getattr(cfg, stage), [name])
        upstream[name] = uri
    uri = pl.run_one(cfg, stage, runner, upstream)
    typer.echo(f"[{stage}] artifact: {uri}")


def report_location(uri: str, endpoint_url: str | None) -> str:
    """Where the eval report is: a local path, or its S3 URI (read from the manifest; nothing is downloaded into
    a cache just to print a path)."""
    if uri.startswith("s3://"):
        manifest, _ = read_manifest(uri, endpoint_url)
        return f"{uri}/{manifest.data_dir}/report.html"
    return str(fetch(uri, endpoint_url=endpoint_url).path / "report.html")


@app.command("run-all")
def run_all_cmd(
    config: ConfigOpt,
    data: DataOpt = None,
    backend: BackendOpt = "local",
    store: StoreOpt = None,
    dry_run: DryRunOpt = False,
    verbose: bool = False,
) -> None:
    """Run every configured stage in order, each fed the manifests of the ones before."""
    _setup_logging(verbose)
    cfg = _load(config, data, store)
    runner, cfg = _prepared_backend(backend, cfg, dry_run, data)
    if dry_run:
        return _print_dry_run(runner, cfg)
    produced = pl.run_all(cfg, runner)
    for stage, uri in produced.items():
        typer.echo(f"[{stage}] artifact: {uri}")
    if "eval" in produced:
        typer.echo(f"report: {report_location(produced['eval'], cfg.store.s3_endpoint_url)}")


@manifest_app.command("show")
def manifest_show(
    uri: Annotated[str, typer.Argument(help="Artifact folder or manifest.json URI")],
    endpoint: EndpointOpt = None,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Print a manifest: kind, lineage, files and metrics."""
    manifest, digest = read_manifest(uri, endpoint)
    if as_json:
        typer.echo(manifest.model_dump_json(indent=2))
        return
    typer.echo(f"{manifest.kind} artifact {manifest.artifact_id} (stage {manifest.stage}, run {manifest.run_id})")
    typer.echo(f"schema {manifest.schema_version}, created {manifest.created_at.isoformat()}, sha256 {digest}")
    typer.echo(f"producer: {manifest.producer.package} {manifest.producer.version} git {manifest.producer.git_sha}")
    for ref in manifest.inputs:
        typer.echo(f"input {ref.name}: {ref.uri} ({ref.sha256[:16]})")
    typer.echo("\n".join(f"{f.size:>12}  {f.sha256[:12]}  {f.path}" for f in manifest.files))
    typer.echo(json.dumps(manifest.metrics, indent=2, default=str)[:4000])


@manifest_app.command("validate")
def manifest_validate(
    uri: Annotated[str, typer.Argument(help="Artifact folder or manifest.json URI")], endpoint: EndpointOpt = None
) -> None:
    """Check the manifest's schema and recorded digest, every file's size and sha256, and that the artifact holds
    nothing its manifest does not list."""
    art = fetch(uri, endpoint_url=endpoint)
    typer.echo(f"{art.uri}: valid ({len(art.manifest.files)} files verified)")


@app.command("status")
def status_cmd(
    run_id: Annotated[str, typer.Argument(help="Pipeline run id")],
    store: StoreRootOpt = ".dilforge/store",
    endpoint: EndpointOpt = None,
) -> None:
    """Show each stage of a run: artifact, produced or reused, failure reason; flags a run whose process is gone."""
    from .records import DamagedRecord, parse_record

    st = ArtifactStore(store, endpoint)
    source = f"{st.backend.uri}/{st.run_record_key(run_id)}"
    try:
        doc = parse_record(st.read_run_record(run_id), source)
    except NotFound:
        fail(f"no run {run_id!r} in store {store}")
    except DamagedRecord as exc:
        fail(f"{one_line(exc)} (the next run of this id sets it aside and starts a fresh record)")
    status, owner = doc.status, doc.owner
    running = status == "running" or any(i.status == "running" for i in doc.stages.values())
    note = ""
    here = isinstance(owner.get("pid"), int) and owner.get("host") == socket.gethostname()
    if running and here and not owner_alive(owner):
        status = "stale"
        note = (
            f" — process {owner.get('pid')} on {owner.get('host')} is gone (killed or crashed); "
            "rerun the same command to resume"
        )
    elif running and not here:
        note = f" — owned by process {owner.get('pid')} on {owner.get('host')}"
    typer.echo(f"run {run_id}: {status}{note} (updated {doc.updated_at})")
    for stage, info in doc.stages.items():
        line = f"  {stage:<10} {info.status:<9} {st.resolve(info.artifact)}"
        if info.error:
            line += f"\n             {info.error.splitlines()[0][:200] if info.error.strip() else ''}"
        for other in info.also:  # a concurrent run's (or an earlier import's) artifact, kept referenced
            line += f"\n             also {st.resolve(other)}"
        typer.echo(line)


@app.command("gc")
def gc_cmd(
    store: StoreRootOpt = ".dilforge/store",
    workdir: Annotated[
        Path | None,
        typer.Option("--workdir", help="Local backend work folders (default DILFORGE_WORKDIR or .dilforge/work)"),
    ] = None,
    delete: Annotated[bool, typer.Option("--delete", help="Remove what is listed (default: list only).")] = False,
    unreferenced: Annotated[
        bool, typer.Option("--unreferenced", help="Also list artifacts no run record in this store names.")
    ] = False,
    min_age_minutes: Annotated[
        float, typer.Option("--min-age-minutes", min=0, help="Leave orphans and temp files younger than this alone.")
    ] = 60,
    export_dir: Annotated[
        list[Path] | None,
        typer.Option("--export-dir", help="An export --out folder: also list staging folders a killed export left."),
    ] = None,
    endpoint: EndpointOpt = None,
) -> None:
    """List (dry run) or --delete orphan data-* folders, damaged copies, temp files, stale work folders: only what
    dilforge provably made (a marked store, marked work folders, its writers' exact temp names)."""
    from . import gc

    found = gc.find_store_garbage(ArtifactStore(store, endpoint), min_age_minutes * 60, unreferenced)
    work = Path(workdir or coordinator_settings().workdir).resolve()
    found += gc.find_work_garbage(work, min_age_minutes * 60, [cache_root()])
    for folder in export_dir or []:
        found += gc.find_staging_garbage(folder)
    for item in found:
        typer.echo(f"{'removing' if delete else 'would remove'} {item.kind:<12} {item.uri}  ({item.why})")
        if delete:
            item.remove()
    verb = "removed" if delete else "found (dry run; --delete to remove)"
    typer.echo(f"{len(found)} item(s) {verb}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
