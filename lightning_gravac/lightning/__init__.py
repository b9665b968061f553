"""lightning-gravac for the unified ``lightning`` package: ``import lightning as L``.

    import lightning as L
    from lightning_gravac.lightning import GraVACStrategy, GraVAC, Static

    L.Trainer(accelerator="cpu", devices=2, strategy=GraVACStrategy("topk"))

Lightning ships its trainer twice: as ``pytorch_lightning`` and, inside the unified package, as ``lightning.pytorch``
(with ``lightning_fabric`` as ``lightning.fabric``). Their classes are distinct, so a strategy or a callback built on
one is refused by the other's ``Trainer``. This package holds the same API built on ``lightning.pytorch``: importing it
installs an import hook that loads the Lightning-facing modules of ``lightning_gravac`` (the strategy, the controllers,
``RunSummary``, ``MeProp``, the loggers and the zoo) a second time, as ``lightning_gravac.lightning.*``, from the same
source files with ``pytorch_lightning`` read as ``lightning.pytorch`` and ``lightning_fabric`` as ``lightning.fabric``.
This is how Lightning itself makes ``lightning.pytorch`` from the ``pytorch_lightning`` sources, and it keeps one
source of truth: no class is copied or maintained twice. The parts that do not touch Lightning (the compressors, the
comm hook and its state, error feedback, momentum correction, the divergence guard, the launcher) are not loaded
again: both flavours share them, so a compressor instance works with either.

Needs ``pip install lightning``. The command line (``python -m lightning_gravac``) and its recipes stay on
``pytorch_lightning``, the package's dependency.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

_ROOT = Path(__file__).resolve().parent.parent  # the lightning_gravac package
_PREFIX = __name__ + "."

#: Modules that stay on ``pytorch_lightning`` whatever they import: the command line, and this package.
_NOT_LOADED_AGAIN = ("cli", "__main__", "lightning")
_LIGHTNING = re.compile(r"\b(?:pytorch_lightning|lightning_fabric)\b")
_IMPORT = re.compile(r"^\s*(?:from|import)\s+lightning_gravac((?:\.\w+)*)", re.MULTILINE)


def _sources() -> dict[str, str]:
    """Every module of ``lightning_gravac`` by relative name ("" for the package), with its source."""
    modules = {}
    for path in sorted(_ROOT.rglob("*.py")):
        parts = list(path.relative_to(_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path.read_text(encoding="utf-8")
    return modules


def _parts(dotted: str) -> list[str]:
    """``".callbacks.gravac"`` (what follows ``lightning_gravac`` in a source) as ``["callbacks", "gravac"]``."""
    return dotted.lstrip(".").split(".") if dotted else []


def _module_of(dotted: str) -> str:
    """The longest leading module path of ``lightning_gravac<dotted>`` (relative; "" is the package)."""
    parts = _parts(dotted)
    for n in range(len(parts), 0, -1):
        where = _ROOT.joinpath(*parts[:n])
        if (where / "__init__.py").is_file() or where.with_suffix(".py").is_file():
            return ".".join(parts[:n])
    return ""


def lightning_facing() -> frozenset[str]:
    """The modules of ``lightning_gravac`` (relative names; "" is the package) loaded again for ``lightning``: those
    whose source names ``pytorch_lightning`` or ``lightning_fabric``, and those that import one of them, found from
    the sources so that a new module cannot be missed."""
    sources = _sources()

    def imported(source: str) -> set[str]:
        # The module a name comes from (`lightning_gravac.callbacks.gravac`, not the packages Python runs on the way).
        return {_module_of(match.group(1)) for match in _IMPORT.finditer(source)}

    own = {name: source for name, source in sources.items() if name.split(".")[0] not in _NOT_LOADED_AGAIN}
    facing = {name for name, source in own.items() if _LIGHTNING.search(source)}
    edges = {name: imported(source) for name, source in own.items()}
    while True:  # the closure over imports
        more = {name for name, targets in edges.items() if targets & facing} - facing
        if not more:
            return frozenset(facing)
        facing |= more


#: Modules of ``lightning_gravac`` (relative names; "" is the package) that import Lightning, loaded again here.
LIGHTNING_FACING = lightning_facing()


def rewrite(source: str) -> str:
    """``source`` of a Lightning-facing module, as the ``lightning`` flavour runs it."""
    source = re.sub(r"\bpytorch_lightning\b", "lightning.pytorch", source)
    source = re.sub(r"\blightning_fabric\b", "lightning.fabric", source)

    def module(match: re.Match[str]) -> str:
        # ``lightning_gravac.callbacks.gravac.GraVAC``: the module ``callbacks.gravac``, then an attribute. The package
        # itself ("") is Lightning-facing, so are its attributes.
        facing = _module_of(match.group(1)) in LIGHTNING_FACING
        return ".".join([__name__, *_parts(match.group(1))]) if facing else match.group(0)

    # Imports of other Lightning-facing modules go to their flavour too; shared modules stay as they are.
    return re.sub(r"\blightning_gravac((?:\.[A-Za-z_]\w*)*)", module, source)


class _Loader(importlib.abc.SourceLoader):
    def __init__(self, path: Path) -> None:
        self.path = path

    def get_filename(self, fullname: str) -> str:
        return str(self.path)

    def get_data(self, path: str) -> bytes:
        return rewrite(Path(path).read_text(encoding="utf-8")).encode("utf-8")


class _Shared(importlib.abc.Loader):
    """Loads a module that does not touch Lightning as the one module both flavours use."""

    def __init__(self, shared: str) -> None:
        self.shared = shared

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.shared)

    def exec_module(self, module: ModuleType) -> None:
        """Already executed, as ``lightning_gravac.<name>``."""


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX):
            return None
        relative = fullname[len(_PREFIX) :]
        if relative not in LIGHTNING_FACING:
            # `lightning_gravac.lightning.compressors` and the like: the shared module itself, under this name too.
            shared = f"lightning_gravac.{relative}"
            if importlib.util.find_spec(shared) is None:
                return None
            return importlib.machinery.ModuleSpec(fullname, _Shared(shared))
        where = _ROOT.joinpath(*relative.split("."))
        package = (where / "__init__.py").is_file()
        origin = where / "__init__.py" if package else where.with_suffix(".py")
        return importlib.util.spec_from_file_location(
            fullname, origin, loader=_Loader(origin), submodule_search_locations=[] if package else None
        )


def _install() -> None:
    try:
        import lightning.pytorch  # noqa: F401, PLC0415 - optional: its absence becomes the error below
    except ImportError as error:
        raise ImportError(
            "lightning_gravac.lightning is built on the unified `lightning` package: `pip install lightning`, or "
            "import from `lightning_gravac` to use `pytorch_lightning`."
        ) from error
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


_install()
# This package's own body: the top-level package's, read for `lightning` (its API, and the strategy registered by
# name in `lightning.pytorch`'s registry).
_TOP = _ROOT / "__init__.py"
_DOC = __doc__
exec(compile(rewrite(_TOP.read_text(encoding="utf-8")), str(_TOP), "exec"))
__doc__ = _DOC
