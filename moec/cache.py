"""moec's compile cache: one folder that survives the process, for every compiler moec runs.

Where: ``MOEC_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/moec``, else ``~/.cache/moec``.
Under it, one folder per device and software (:func:`namespace`): ``<device>/<versions>``,
e.g. ``sm90-nvidia-h100-80gb-hbm3/torch-2.14.1_triton-3.8.0_moec-<digest>``, so that artefacts
of another GPU, torch, Triton or version of moec's ops are never mixed in (the tools key their
entries on most of these too; the folders make the cache easy to inspect and prune). Inside it,
:func:`setup` points each tool's own cache at a subfolder:

- Inductor (``TORCHINDUCTOR_CACHE_DIR``): the FX graph cache and AOTAutograd's cache (both
  switched on; an explicit ``TORCHINDUCTOR_FX_GRAPH_CACHE`` / ``TORCHINDUCTOR_AUTOGRAD_CACHE``
  is kept), and Inductor's autotuning results;
- Triton (``TRITON_CACHE_DIR``): compiled kernels, and the autotuner's choices for moec's own
  kernels outside the shipped tile table (:mod:`moec.kernels.tuning`);
- the CuTe DSL (``CUTE_DSL_CACHE_DIR``), quack's compiled objects and autotuning
  (``QUACK_CACHE_DIR``) and FlashAttention 4's compiled kernels
  (``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``, its cache switched on);
- moec's record of the autotuner's choices (:func:`tuning_record`);
- moec's compiled programs (``programs/``, :mod:`moec.program_cache`).

A variable the user set already is left as it is (their cache wins); the defaults torch writes
into ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` itself (importing Inductor's config
writes the first) are not the user's and are replaced. The call must come before anything
compiles (what compiled before it is in torch's default folders).
:func:`setup` is idempotent (the first call in a process decides).

Concurrency: two ranks or two jobs may fill one cache at once. Inductor, Triton and quack write
each entry to a temporary file renamed into place (readers see a whole entry or none; two
writers of one entry write the same bytes); moec's own files are written the same way
(:func:`write_atomic`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import tempfile
from pathlib import Path

CACHE_ENV = "MOEC_CACHE_DIR"
"""The variable that overrides the cache's root."""

TOOL_DIRS = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "CUTE_DSL_CACHE_DIR": "cute_dsl",
    "QUACK_CACHE_DIR": "quack",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "flash_attn_cute",
}
"""Each tool's cache variable -> its subfolder of the namespace."""

SWITCHES = {
    "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
    "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1",
    "QUACK_CACHE_AUTOTUNING": "1",
}
"""Caches switched on unless the user set the variable (FA4's is off by default; quack's
autotuning results are kept where its kernels ask for it, this makes it every kernel)."""


@dataclasses.dataclass(frozen=True)
class CacheDirs:
    """Where this process caches: the namespace folder and each tool's folder (a user's own
    setting where they made one: ``ours`` is False for those)."""

    root: Path
    folder: Path
    tools: dict[str, Path]
    ours: dict[str, bool]


_ACTIVE: CacheDirs | None = None


def cache_root() -> Path:
    """The cache's root folder (see module); not created."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(home).expanduser() / "moec"


def namespace(device_name: str | None = None, capability: tuple[int, int] | None = None) -> str:
    """``<device>/<versions>``: the GPU's arch and name (``sm90-nvidia-h100-80gb-hbm3``; ``cpu``
    without one, e.g. a CPU run or a build on a machine without a GPU), the torch and Triton
    versions and :func:`moec_key`. ``device_name``/``capability`` default to those of the
    current CUDA device."""
    import torch

    if device_name is None and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name()
        capability = torch.cuda.get_device_capability()
    device = "cpu"
    if device_name is not None:
        arch = f"sm{capability[0]}{capability[1]}" if capability else "sm"
        device = f"{arch}-{_slug(device_name)}"
    versions = f"torch-{_slug(torch.__version__)}_triton-{_slug(_triton_version())}"
    return f"{device}/{versions}_moec-{moec_key()}"


@functools.cache
def moec_key() -> str:
    """A digest of moec's ops, kernels and lowering sources: Inductor's FX graph cache keys on
    a graph's ops by name, not on their Python fake implementations, so a cached graph must
    not outlive a change to them (nor a kernel's to its sources)."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted([*package.glob("ops/**/*.py"), *package.glob("kernels/**/*.py")]):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    for lowering in ("lowering.py", "block_graphs.py"):  # what hands graphs to Inductor
        digest.update((package / "runtime" / lowering).read_bytes())
    return digest.hexdigest()[:12]


def setup(folder: str | Path | None = None) -> CacheDirs:
    """Point every tool's cache into moec's (see module) and return where; once per process,
    before anything compiles (later calls return the first call's answer). ``folder``: the
    namespace folder to use instead of ``cache_root() / namespace()`` (tests)."""
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE
    root = cache_root()
    base = Path(folder) if folder is not None else root / namespace()
    tools, ours = {}, {}
    for variable, sub in TOOL_DIRS.items():
        given = os.environ.get(variable)
        if given and _a_tools_default(variable, given):
            given = None
        ours[variable] = not given
        path = Path(given) if given else base / sub
        if not given:
            path.mkdir(parents=True, exist_ok=True)
            os.environ[variable] = str(path)
        tools[variable] = path
    for variable, value in SWITCHES.items():
        os.environ.setdefault(variable, value)
    _switch_on_inductor_caches()
    _ACTIVE = CacheDirs(root, base, tools, ours)
    return _ACTIVE


def active() -> CacheDirs | None:
    """The cache :func:`setup` set up in this process (None before)."""
    return _ACTIVE


def owned_folder(variable: str) -> Path | None:
    """The folder :func:`setup` pointed tool cache ``variable`` at, if it is moec's (None
    before setup, or where the user set the variable)."""
    if _ACTIVE is None or not _ACTIVE.ours.get(variable):
        return None
    return _ACTIVE.tools[variable]


def tuning_record() -> Path | None:
    """The file recording the autotuner's choices for moec's kernels (None before
    :func:`setup`): read by ``benchmarks/tune_table.py`` to fill the shipped table."""
    return None if _ACTIVE is None else _ACTIVE.folder / "tuning_choices.json"


def write_atomic(path: Path, content: str | bytes) -> None:
    """Write ``content`` to ``path`` through a temporary file in the same folder renamed over
    it: a concurrent reader sees the old file or the new one, never part of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _a_tools_default(variable: str, value: str) -> bool:
    """Whether ``value`` is what torch wrote into ``variable`` itself, not the user: importing
    Inductor's config sets ``TORCHINDUCTOR_CACHE_DIR`` to its default folder (``import moec``
    does that), and Inductor's first kernel sets ``TRITON_CACHE_DIR`` to a folder inside it."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    inductor = os.path.abspath(default_cache_dir())
    if variable == "TORCHINDUCTOR_CACHE_DIR":
        return os.path.abspath(value) == inductor
    if variable == "TRITON_CACHE_DIR":
        return os.path.abspath(value).startswith(os.path.join(inductor, "triton") + os.sep)
    return False


def _switch_on_inductor_caches() -> None:
    """Inductor reads its cache switches when it is imported: set them on the configs too
    (unless the user's variable says otherwise)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1":
        inductor_config.fx_graph_cache = True
    if os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1":
        functorch_config.enable_autograd_cache = True


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def _slug(text: str) -> str:
    """``text`` as one folder name: lower case, runs of other characters as ``-``."""
    return re.sub(r"[^a-z0-9.+]+", "-", text.lower()).strip("-")
