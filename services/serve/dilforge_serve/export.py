"""`export ARTIFACT --format gguf --quant f16|q8_0|q4_k_m --out DIR`: a GGUF for llama.cpp, Ollama and LM
Studio, with an Ollama Modelfile beside it, written by llama.cpp's own converter and quantizer from the folder
the server would serve. The pre-tokenizer must be the base tokenizer's (llama.cpp names it by hash); both files
are published from a staging folder and never overwrite."""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tarfile
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Literal

import typer
from dilforge_shared import locks
from dilforge_shared.errors import DilforgeError, ManifestNotFound
from dilforge_shared.families import GENERATION_CONFIG_FILE, Family, detect_family
from dilforge_shared.models import resolve
from dilforge_shared.settings import cache_root
from dilforge_shared.specials import special_token_ids
from dilforge_shared.store import STORE_MARKER, read_manifest
from dilforge_shared.workers import die_with_parent

from . import run
from .prepare import check_system_prompt, prepare, resolve_served_model

log = logging.getLogger("dilforge.export")

QUANTS = ("f16", "q8_0", "q4_k_m")
Q4_K_M_FTYPE = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M
SOURCE_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


class ExportError(DilforgeError):
    """A one-line reason the artifact cannot be exported, saying what to do."""


def run_child(cmd: list[str]) -> subprocess.CompletedProcess:
    """A child that dies with this process; output captured."""
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        check=False,
        preexec_fn=functools.partial(die_with_parent, os.getpid()),  # no converter outlives its export
    )


# the llama.cpp converter sources inside a pinned sdist on PyPI: (package, version, sha256)
LLAMA_CPP = ("llama-cpp-python", "0.3.36", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")


def converter_sources() -> Path:
    """The converter and its gguf-py, extracted once into the cache from the pinned sdist (`pip download`)."""
    package, version, sha256 = LLAMA_CPP
    requirement, folder = f"{package}=={version}", cache_root() / "llama.cpp" / f"{package}-{version}"
    done = folder / ".complete"
    if done.is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in locks.abandoned(folder.parent, "download"):
        locks.remove_abandoned(stale)
    with locks.staging_dir(folder.parent, "download") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "--quiet"]
        cmd += ["--disable-pip-version-check", "-d", str(tmp), requirement]
        log.info("llama.cpp converter: %s", " ".join(cmd))
        proc = run_child(cmd)
        archives = sorted(tmp.glob("*.tar.gz"))
        if proc.returncode != 0 or len(archives) != 1:
            last = (proc.stderr.strip().splitlines() or ["no archive"])[-1]
            raise ExportError(f"pip download {requirement} failed: {last}")
        digest = hashlib.sha256(archives[0].read_bytes()).hexdigest()
        if digest != sha256:
            raise ExportError(f"{archives[0].name} has sha256 {digest}, not the pinned {sha256}")
        out = tmp / "src"
        with tarfile.open(archives[0]) as tar:
            root = f"{package.replace('-', '_')}-{version}/vendor/llama.cpp/"
            members = [
                m
                for m in tar.getmembers()
                if m.name.startswith(root) and m.name[len(root) :].startswith(SOURCE_MEMBERS) and m.isfile()
            ]
            for m in members:
                m.name = m.name[len(root) :]
            tar.extractall(out, members=members, filter="data")
        (out / ".complete").write_text(requirement + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        out.replace(folder)
    return folder


# ---- the pre-tokenizer --------------------------------------------------------------------------------------
def base_tokenizer_dir(uri: str, endpoint_url: str | None = None, depth: int = 4) -> Path | None:
    """The tokenizer folder of the base model in an artifact's lineage: the nearest upstream `model`-stage
    artifact (or a base model named by folder in a CPT config), None when there is none (a scratch model)."""
    frontier = [uri]
    for _ in range(depth):
        following = []
        for current in frontier:
            try:
                manifest, _ = read_manifest(current, endpoint_url)
            except ManifestNotFound:
                continue
            for ref in manifest.inputs:
                if ref.kind == "manifest":
                    try:
                        upstream, _ = read_manifest(ref.uri, endpoint_url)
                    except ManifestNotFound:
                        continue
                    if upstream.stage == "model":
                        return resolve(ref.uri, "model", endpoint_url=endpoint_url).path
                    following.append(ref.uri)
                elif ref.name.startswith("model:") and manifest.stage == "cpt":
                    return resolve(ref.uri, "model", endpoint_url=endpoint_url).path
        frontier = following
    return None


def _tokenizer_json(folder: Path) -> dict:
    path = folder / "tokenizer.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{folder}: no tokenizer.json (give the tokenizer folder of the base model)") from None
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: cannot read it as a tokenizer ({exc})") from None
    if not isinstance(doc, dict):
        raise ExportError(f"{path}: not a tokenizer (a JSON object expected)")
    return doc


def check_pre_tokenizer(tokenizer_dir: Path, base_dir: Path) -> None:
    """The tokenizer's pre-tokenizer and normalizer must be the base's, byte for byte as JSON."""
    ours, base = (_tokenizer_json(d) for d in (tokenizer_dir, base_dir))
    for part in ("pre_tokenizer", "normalizer"):
        if ours.get(part) != base.get(part):
            raise ExportError(
                f"the tokenizer's {part} differs from the base model's ({base_dir}): a `replace` tokenizer has "
                "its own, which llama.cpp cannot name, and a forced name would make it read text with other ids; "
                "export a model trained with tokenizer strategy base or extend"
            )


# ---- conversion ---------------------------------------------------------------------------------------------
def convert(sources: Path, folder: Path, outfile: Path, outtype: str, base_tok: Path) -> None:
    cmd = [sys.executable, "-m", "dilforge_serve.gguf_convert", str(sources), str(folder), str(outfile), outtype]
    cmd.append(str(base_tok))
    log.info("converting %s to %s (%s)", folder, outfile.name, outtype)
    proc = run_child(cmd)
    if proc.returncode != 0 or not outfile.is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise ExportError(f"llama.cpp's converter failed (exit {proc.returncode}):\n{tail}")
    for line in proc.stdout.splitlines():
        if line.startswith("gguf_convert:"):
            log.info("%s", line)


def quantize(source: Path, out: Path, quant: str) -> None:
    """llama.cpp's quantizer (the library's C API, as `llama-quantize` calls it)."""
    try:
        import llama_cpp
    except ImportError:
        raise ExportError(
            f"--quant {quant} needs llama.cpp's quantizer: pip install llama-cpp-python "
            "(scripts/setup.sh --export builds it)"
        ) from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = Q4_K_M_FTYPE
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if rc != 0 or not out.is_file():
        raise ExportError(f"llama.cpp's quantizer failed on {source.name} (code {rc})")


# ---- the Ollama Modelfile -------------------------------------------------------------------------------------
OLLAMA_TEMPLATES = {
    "chatml": (
        "{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
        "<|im_start|>assistant\n"
    ),
    "llama3": (
        "<|begin_of_text|>{{- if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>"
        "{{ end }}{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}"
        "<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
}


def modelfile(gguf_name: str, family: Family, system_prompt: str | None, generation: dict | None = None) -> str:
    """Ollama's Modelfile: the file, the family's chat template in Ollama's Go template syntax, its stops,
    the SFT system prompt as the default system message, and the model's repetition penalty (its
    generation_config.json `repetition_penalty`, Ollama's `repeat_penalty`; llama.cpp reads it from the GGUF)."""
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{OLLAMA_TEMPLATES[family.name]}"""']
    if system_prompt:
        lines.append(f'SYSTEM """{system_prompt}"""')
    lines += [f'PARAMETER stop "{t}"' for t in family.stop_tokens]
    if penalty := (generation or {}).get("repetition_penalty"):
        if isinstance(penalty, bool) or not isinstance(penalty, int | float) or not math.isfinite(penalty):
            raise ExportError(f"generation_config.json: repetition_penalty {penalty!r} is not a finite number")
        lines.append(f"PARAMETER repeat_penalty {float(penalty)}")
    return "\n".join(lines) + "\n"


# ---- where the files go ---------------------------------------------------------------------------------------
def check_out_dir(out_dir: Path) -> None:
    """--out must be a folder or creatable as one, outside any artifact store (a file added to an artifact makes
    it fail validation): checked before any work, so a typo costs nothing."""
    resolved = out_dir.resolve()
    if store := next((d for d in (resolved, *resolved.parents) if (d / STORE_MARKER).exists()), None):
        raise ExportError(f"--out {out_dir} is inside the artifact store {store}; export to a folder outside it")
    if out_dir.is_symlink() and not out_dir.exists():
        raise ExportError(f"--out {out_dir} is a symlink to nothing; give a folder")
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ExportError(f"--out {out_dir} is a file, not a folder; give a folder")
        return
    parent = next(p for p in out_dir.absolute().parents if p.exists())
    if not parent.is_dir():
        raise ExportError(f"--out {out_dir}: {parent} is a file, not a folder")


NO_HARD_LINKS = (errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP, errno.EMLINK)  # FAT/exFAT sticks, some mounts


def _place(src: Path, dest: Path) -> tuple[int, int]:
    """`src` at `dest`, created exclusively: a hard link, or a copy where the filesystem has none. Returns the
    (device, inode) of what was created there."""
    try:
        os.link(src, dest)
        st = src.stat()
    except OSError as exc:
        if exc.errno not in NO_HARD_LINKS:
            raise
        with open(src, "rb") as fin, open(dest, "xb") as fout:
            st = os.fstat(fout.fileno())
            try:
                shutil.copyfileobj(fin, fout, 16 << 20)
            except BaseException:
                _remove_own(dest, (st.st_dev, st.st_ino))
                raise
    return st.st_dev, st.st_ino


def _remove_own(path: Path, ident: tuple[int, int]) -> None:
    """Unlink `path` only if it is still the file this export created there (same device and inode)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == ident:
        path.unlink()


def link_into(work: Path, out_dir: Path, names: list[str]) -> None:
    """Place each staged file in `out_dir`, never over anything (a file, a symlink, a link that appeared
    meanwhile). On failure remove only what this call created there: checked by device and inode."""
    made: list[tuple[Path, tuple[int, int]]] = []
    try:
        for name in names:
            try:
                made.append((out_dir / name, _place(work / name, out_dir / name)))
            except FileExistsError:
                raise ExportError(
                    f"{out_dir / name} appeared during the export (another export into this --out?); "
                    "exports are never overwritten: nothing of this one was kept"
                ) from None
    except BaseException:
        for path, ident in made:
            _remove_own(path, ident)
        raise


# ---- the command ----------------------------------------------------------------------------------------------
def export(
    artifact: str,
    out_dir: Path,
    quant: str,
    endpoint_url: str | None = None,
    base_tokenizer: Path | None = None,
    system_prompt: str | None = None,
) -> list[Path]:
    if quant not in QUANTS:
        raise ExportError(f"--quant {quant!r}: choose one of {', '.join(QUANTS)}")
    check_out_dir(out_dir)
    if base_tokenizer is not None and not base_tokenizer.is_dir():
        raise ExportError(f"--base-tokenizer {base_tokenizer}: no such folder (give the base model's tokenizer folder)")
    try:
        spec = resolve_served_model(artifact, endpoint_url=endpoint_url, system_prompt=system_prompt)
    except DilforgeError as exc:
        raise ExportError(
            f"{artifact}: no model to export ({exc}); give a CPT or SFT artifact (or a model artifact / HF folder)"
        ) from None
    gguf_name = f"{spec.model_id}-{quant}.gguf"
    modelfile_name = f"{spec.model_id}-{quant}.Modelfile"  # one per export: several quants share a folder
    targets = [out_dir / gguf_name, out_dir / modelfile_name]
    if existing := [str(p) for p in targets if os.path.lexists(p)]:
        raise ExportError(f"{', '.join(existing)} exists; exports are never overwritten: choose another --out")
    field = "--system-prompt" if system_prompt else f"{artifact}: its SFT config's system_prompt"
    check_system_prompt(spec.system_prompt, field, spec.tokenizer_dir)
    base_tok = base_tokenizer or base_tokenizer_dir(artifact, endpoint_url)
    if base_tok is None:
        raise ExportError(
            f"{artifact}: no base model in its lineage to take llama.cpp's pre-tokenizer from (a scratch model); "
            "pass --base-tokenizer DIR, the tokenizer folder its tokenizer extends"
        )
    check_pre_tokenizer(spec.tokenizer_dir, base_tok)
    family = detect_family(special_token_ids(spec.tokenizer_dir / "tokenizer.json"), str(spec.tokenizer_dir))
    sources = converter_sources()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"--out {out_dir}: cannot create the folder ({exc.strerror or exc})") from None
    for stale in locks.abandoned(out_dir, "export"):
        log.info("removing %s, left by an export that was killed", stale)
        locks.remove_abandoned(stale)
    with ExitStack() as stack:
        try:
            work = stack.enter_context(locks.staging_dir(out_dir, "export"))
        except OSError as exc:
            raise ExportError(f"--out {out_dir}: cannot write there ({exc.strerror or exc})") from None
        _build(spec, work, sources, (gguf_name, modelfile_name), quant, base_tok, family)
        link_into(work, out_dir, [gguf_name, modelfile_name])
    log.info(
        "exported %s → %s (%.1f MB) and its Modelfile", spec.description, targets[0], targets[0].stat().st_size / 1e6
    )
    return targets


def _build(spec, work: Path, sources: Path, names: tuple[str, str], quant: str, base_tok: Path, family: Family) -> None:
    """The GGUF and its Modelfile, written into the staging folder `work`."""
    gguf_name, modelfile_name = names
    folder = prepare(spec, work / "model")
    tok_config = folder / "tokenizer_config.json"  # the GGUF's eos is its eos_token: the end of an assistant turn
    config = json.loads(tok_config.read_text(encoding="utf-8")) if tok_config.is_file() else {}
    tok_config.write_text(json.dumps({**config, "eos_token": family.eot}, indent=2), encoding="utf-8")
    staged = work / gguf_name
    if quant == "q4_k_m":
        convert(sources, folder, work / "f16.gguf", "f16", base_tok)
        quantize(work / "f16.gguf", staged, quant)
    else:
        convert(sources, folder, staged, quant, base_tok)
    generation = json.loads((folder / GENERATION_CONFIG_FILE).read_text(encoding="utf-8"))  # prepare wrote it
    (work / modelfile_name).write_text(modelfile(gguf_name, family, spec.system_prompt, generation), encoding="utf-8")


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command("export")
def export_cmd(
    artifact: Annotated[
        str, typer.Argument(help="CPT or SFT artifact URI (store folder or s3://), a model artifact or HF folder.")
    ],
    out: Annotated[Path, typer.Option("--out", help="Folder for <model id>-<quant>.gguf and .Modelfile.")],
    fmt: Annotated[Literal["gguf"], typer.Option("--format", help="gguf (llama.cpp, Ollama, LM Studio).")] = "gguf",
    quant: Annotated[str, typer.Option("--quant", help=f"One of {', '.join(QUANTS)}.")] = "q8_0",
    base_tokenizer: Annotated[
        Path | None, typer.Option("--base-tokenizer", help="The base model's tokenizer folder (default: lineage).")
    ] = None,
    system_prompt: Annotated[
        str | None, typer.Option("--system-prompt", help="Default system message; default the SFT config's.")
    ] = None,
    s3_endpoint_url: Annotated[
        str | None,
        typer.Option("--s3-endpoint-url", envvar="DILFORGE_S3_ENDPOINT_URL", help="S3-compatible endpoint."),
    ] = None,
) -> None:
    """Export a CPT or SFT artifact as a GGUF for llama.cpp / Ollama, and an Ollama Modelfile beside it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for path in export(artifact, out, quant, s3_endpoint_url, base_tokenizer, system_prompt):
        typer.echo(path)


def main(argv: list[str] | None = None) -> int:
    return run(app, sys.argv[1:] if argv is None else list(argv), "python -m dilforge_serve.export")


if __name__ == "__main__":
    sys.exit(main())
