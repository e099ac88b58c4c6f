"""The tree's import rules (docs/architecture.md, "Import rules"), read from the source.

Every ``import`` in ``sidecar/`` is found with ``ast``, the lazy ones inside functions
and under ``TYPE_CHECKING`` too, so a rule broken only on a rarely taken path still
fails here. The runtime side of the same promise (the public API imports in a bare
environment) is ``tests/train/test_client_stdlib_only.py``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "sidecar"
STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}
# The one framework each integration may import (lazily, except in the callback modules).
FRAMEWORKS = {
    "sidecar.integrations.distributed": {"torch"},
    "sidecar.integrations.dcp": {"torch"},
    "sidecar.integrations.lightning": {"torch", "lightning", "pytorch_lightning"},
    "sidecar.integrations.transformers": {"torch", "transformers"},
    "sidecar.integrations.verl": {"verl", "ray"},
    "sidecar.integrations.verl_trainer": {"verl", "ray"},
    "sidecar.integrations.ray_nodes": {"ray"},
    "sidecar.integrations.ray_drain": {"ray"},
}
# The callback modules: their classes derive from the framework's base class (so IDEs and
# mypy see them), so these two alone import their framework at their top (issue 21, item 8).
CALLBACK_MODULES = {
    "sidecar.integrations.transformers": {"transformers"},
    "sidecar.integrations.lightning": {"lightning", "pytorch_lightning"},
}
SHARED = ("sidecar.models", "sidecar.timeparse", "sidecar.slurmtext")
HOST_SOURCE_NEEDS = ("sidecar.host.sources", *SHARED)


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module (a submodule when ``from pkg import sub`` names one)
    names: tuple[str, ...]  # the names taken by ``from ... import``
    top_level: bool  # run when the module loads (not inside a function)
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    base = PACKAGE_ROOT.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


MODULES = {_module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _imports(module: str, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[Import] = []

    def visit(node: ast.AST, top_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = top_level and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(module, alias.name, (), top_level, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0, f"{module}:{child.lineno}: relative import"
                base = child.module or ""
                names = tuple(alias.name for alias in child.names)
                submodules = [f"{base}.{n}" for n in names if _is_module(f"{base}.{n}")]
                for target in submodules or [base]:
                    found.append(Import(module, target, names, top_level, child.lineno))
            visit(child, nested)

    visit(tree, True)
    return found


IMPORTS = [found for module, path in MODULES.items() for found in _imports(module, path)]


def _project(name: str) -> bool:
    return name == "sidecar" or name.startswith("sidecar.")


def _in(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _where(found: Import) -> str:
    return f"{found.module}:{found.line} imports {found.target}"


def test_the_tree_has_the_three_sides() -> None:
    for package in (
        "sidecar.train", "sidecar.checkpoint", "sidecar.host", "sidecar.tools",
        "sidecar.integrations", "sidecar.cli",
    ):
        assert package in MODULES, package
    flat = sorted(m for m in MODULES if m.count(".") == 1 and not _is_package(m))
    # Beside the groups (the entry point is the CLI package) only the shared modules.
    assert flat == ["sidecar.models", "sidecar.slurmtext", "sidecar.timeparse"]


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def test_shared_modules_import_nothing_from_the_project() -> None:
    broken = [_where(i) for i in IMPORTS if i.module in SHARED and _project(i.target)]
    assert broken == []


# Restoring a checkpoint's NumPy / torch RNG state needs that library, imported only when
# the checkpoint holds its state (and the program could save it, so it is installed).
RNG_RESTORE = {("sidecar.checkpoint.rng", "numpy"), ("sidecar.checkpoint.rng", "torch")}


def test_training_side_is_standard_library_and_training_side_only() -> None:
    allowed = ("sidecar.train", "sidecar.checkpoint", *SHARED)
    broken = [
        _where(i)
        for i in IMPORTS
        if _in(i.module, "sidecar.train", "sidecar.checkpoint") or i.module == "sidecar"
        if not (_in(i.target, *allowed) or i.target.split(".")[0] in STDLIB)
        if not ((i.module, i.target) in RNG_RESTORE and not i.top_level)
    ]
    assert broken == []


def test_integrations_import_the_training_side_and_their_framework_only() -> None:
    broken = []
    for found in IMPORTS:
        if not _in(found.module, "sidecar.integrations"):
            continue
        top = found.target.split(".")[0]
        inside = ("sidecar.train", "sidecar.checkpoint", "sidecar.integrations", *SHARED)
        if _in(found.target, *inside) or top in STDLIB:
            continue
        if top in FRAMEWORKS.get(found.module, set()) and not found.top_level:
            continue  # its own framework, imported lazily
        if top in CALLBACK_MODULES.get(found.module, set()):
            continue  # a callback module's own framework, its class's base
        broken.append(_where(found))
    assert broken == []


def test_the_base_install_never_imports_a_callback_module() -> None:
    """``import sidecar`` and ``import sidecar.integrations`` stay standard library only."""
    assert set(CALLBACK_MODULES) <= set(MODULES)
    broken = [
        _where(i)
        for i in IMPORTS
        if i.target in CALLBACK_MODULES
        if i.module in ("sidecar", "sidecar.integrations")
        or _in(i.module, "sidecar.train", "sidecar.checkpoint")
        # Nor another integration at its top: it would then need that framework too.
        or (i.top_level and i.module != i.target and _in(i.module, "sidecar.integrations"))
    ]
    assert broken == []


def test_the_checkpoint_format_imports_only_itself_and_the_shared_modules() -> None:
    """Both sides read and write checkpoints: the format depends on neither of them."""
    broken = [
        _where(i)
        for i in IMPORTS
        if _in(i.module, "sidecar.checkpoint")
        if not (_in(i.target, "sidecar.checkpoint", *SHARED) or i.target.split(".")[0] in STDLIB)
        if not ((i.module, i.target) in RNG_RESTORE and not i.top_level)
    ]
    assert broken == []


def test_nothing_outside_the_host_side_imports_it() -> None:
    # The CLI (lazily) and the tools (the demo starts a daemon) are the exceptions.
    broken = [
        _where(i)
        for i in IMPORTS
        if _in(i.target, "sidecar.host")
        and not _in(i.module, "sidecar.host", "sidecar.tools")
        and not (_in(i.module, "sidecar.cli") and not i.top_level)
    ]
    assert broken == []


# A command-line view parses arguments and prints for a person: the CLI package's job
# (issue 38, item 4). The training side is a library the job imports.
def test_the_training_side_holds_no_command_line_views() -> None:
    views = [_where(i) for i in IMPORTS
             if _in(i.module, "sidecar.train", "sidecar.checkpoint") and i.target == "argparse"]
    commands = [f"{module} defines {name}"
                for module, path in MODULES.items() if _in(module, "sidecar.train")
                for name, _ in _names(path) if name.startswith("cmd_")]
    assert views == [] and commands == []


def test_host_side_never_imports_tools_integrations_or_the_cli() -> None:
    broken = [
        _where(i)
        for i in IMPORTS
        if _in(i.module, "sidecar.host")
        and _in(i.target, "sidecar.tools", "sidecar.integrations", "sidecar.cli")
    ]
    assert broken == []


# The repository's scripts (tools/: docs/simulation.md's writer among them) are not in the
# wheel (issue 38, item 4): nothing the wheel ships imports one.
SCRIPTS = PACKAGE_ROOT.parent / "tools"


def test_nothing_in_the_package_imports_the_repositorys_scripts() -> None:
    scripts = {path.stem for path in SCRIPTS.glob("*.py")}
    assert {"simulation_report", "simulation_heavy"} <= scripts
    broken = [_where(i) for i in IMPORTS
              if i.target.split(".")[0] in scripts or _in(i.target, "tools")]
    assert broken == []


def test_inside_the_host_side_data_flows_one_way() -> None:
    broken = []
    for found in IMPORTS:
        source = _in(found.module, "sidecar.host.sources")
        if source and _project(found.target) and not _in(found.target, *HOST_SOURCE_NEEDS):
            broken.append(_where(found))  # a source needs only models and timeparse
        if found.module == "sidecar.host.api" and _in(found.target, "sidecar.host.sources"):
            broken.append(_where(found))  # the API reads the store, never a source
        polls = found.module == "sidecar.host.poller"
        if polls and _in(found.target, "sidecar.host.sources") and not found.target.endswith(
            ".base"
        ):
            broken.append(_where(found))
    assert broken == []


# The features (docs/architecture.md, "features/"): each a package under
# sidecar/host/features/ that the registry lists. The core never names one: create_app,
# the page and the daemon know them only as the registry's list. A feature reads another
# only as the job events' history (what every other feature is computed from).
FEATURES = "sidecar.host.features"
READ_BY_EVERY_FEATURE = f"{FEATURES}.events"


FEATURE_PACKAGES = frozenset(
    f"{FEATURES}.{path.name}" for path in (PACKAGE_ROOT / "host" / "features").iterdir()
    if (path / "__init__.py").is_file())


def _feature_of(module: str) -> str:
    """The feature package ``module`` is in, or ""."""
    return ".".join(module.split(".")[:4]) if _in(module, *FEATURE_PACKAGES) else ""


def test_the_core_knows_the_features_only_as_the_registrys_list() -> None:
    core = [_where(i) for i in IMPORTS
            if _in(i.module, "sidecar.host") and not _in(i.module, FEATURES)
            and _feature_of(i.target)]
    registry = {f"{FEATURES}.registry", FEATURES}
    listed = {_feature_of(i.target) for i in IMPORTS
              if i.module in registry and _feature_of(i.target)}
    assert len(FEATURE_PACKAGES) >= 5 and core == [] and listed == FEATURE_PACKAGES


def test_a_feature_reads_no_other_feature_but_the_job_events() -> None:
    broken = [_where(i) for i in IMPORTS
              if _feature_of(i.module) and _feature_of(i.target)
              and _feature_of(i.target) not in (_feature_of(i.module), READ_BY_EVERY_FEATURE)]
    assert broken == []


def test_only_the_wiring_picks_sources_and_builds_the_uploader() -> None:
    wiring = {"sidecar.host.daemon", "sidecar.host.settings"}
    broken = [
        _where(i)
        for i in IMPORTS
        if i.target in ("sidecar.host.sources.registry", "uvicorn")
        and i.module not in wiring
    ]
    uploader = [
        _where(i)
        for i in IMPORTS
        if _in(i.module, "sidecar.host.upload") and i.target == "sidecar.host.settings"
        and "Settings" in i.names
    ]
    assert broken == [] and uploader == []


# The daemon's state file has one owner (issue 21, item 3): the settings define where it is,
# the wiring hands that path to StateFile, and sidecar.host.statefile alone reads and
# writes it. The uploader writes checkpoints, not the state file, with the same helpers.
STATE_FILE_OWNER = "sidecar.host.statefile"
STATE_FILE_PATH_READERS = {"sidecar.host.settings", "sidecar.host.daemon", STATE_FILE_OWNER}


def _names(path: Path) -> list[tuple[str, int]]:
    """Every identifier of a module: names, attributes, parameters, keywords."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        name = (node.id if isinstance(node, ast.Name) else node.attr
                if isinstance(node, ast.Attribute) else node.arg
                if isinstance(node, (ast.arg, ast.keyword)) else None)
        if name:
            found.append((name, node.lineno))  # type: ignore[attr-defined]
    return found


def _state_file_breaks(modules: dict[str, Path]) -> list[str]:
    writers = [
        _where(found)
        for module, path in modules.items() for found in _imports(module, path)
        if _in(module, "sidecar.host") and not _in(module, "sidecar.host.upload")
        and found.target == "sidecar.checkpoint.durable" and module != STATE_FILE_OWNER
    ]
    path_readers = [
        f"{module}:{line} names {name}"
        for module, path in modules.items()
        if _in(module, "sidecar.host", "sidecar.cli", "sidecar.tools")
        and module not in STATE_FILE_PATH_READERS
        for name, line in _names(path) if "state_file" in name
    ]
    return writers + path_readers


def test_only_the_state_file_module_opens_the_state_file() -> None:
    assert _state_file_breaks(MODULES) == []


def test_the_state_file_rule_sees_a_poller_that_writes_it(tmp_path: Path) -> None:
    # The poller as it was before the state file had one owner.
    poller = tmp_path / "poller.py"
    poller.write_text(
        "from sidecar.checkpoint.durable import replace_atomically\n"
        "class Poller:\n"
        "    def __init__(self, state_file=None):\n"
        "        self._state_file = state_file\n"
        "    def save(self):\n"
        "        replace_atomically(self._state_file, b'{}', '.tmp')\n")
    breaks = _state_file_breaks({"sidecar.host.poller": poller})
    assert breaks[0] == "sidecar.host.poller:1 imports sidecar.checkpoint.durable"
    assert "sidecar.host.poller:3 names state_file" in breaks


UPLOAD_PLAN = "sidecar.host.upload.plan"


def test_the_simulator_runs_the_uploaders_own_pure_plan() -> None:
    """One estimate and one give-way rule (issue 21, item 4): the plan imports only the
    standard library (and the shared modules), and the simulator takes them from it,
    reaching into the host side for nothing else (the daemon's defaults live in the plan)."""
    impure = [
        _where(i)
        for i in IMPORTS
        if i.module == UPLOAD_PLAN
        if not (i.target.split(".")[0] in STDLIB or _in(i.target, *SHARED))
    ]
    simulator = [i for i in IMPORTS if _in(i.module, "sidecar.tools.simulate")]
    elsewhere = [_where(i) for i in simulator
                 if _in(i.target, "sidecar.host")
                 and i.target != UPLOAD_PLAN]
    assert impure == [] and elsewhere == []
    assert "sidecar.tools.simulate.engine" in {i.module for i in simulator
                                               if i.target == UPLOAD_PLAN}


# The upload package's doors (issue 38, item 2): the wiring builds the uploader and the
# follower, the restore command runs ``fetch``, the settings check a URL (``location``).
# Everything else in upload/ (the stream, the stages, the idle work) is the package's own;
# the S3 modules (boto3) among them: a volume's uploader never loads boto3 (issue 39, item 9).
UPLOAD_PUBLIC = {f"sidecar.host.upload.{name}" for name in (
    "plan", "location", "storage_config", "uploader", "follower", "follow_sources", "fetch",
    "volume", "volume_section",
)}
# Standard library only: a URL's check, and the upload settings' defaults (with the plan).
SETTINGS_FROM_UPLOAD = {"sidecar.host.upload.location", "sidecar.host.upload.plan"}
# The settings' table and its value parsers (``--upload-to``'s among them).
SETTINGS_MODULES = {"sidecar.host.settings", "sidecar.host.setting_parsers"}


def test_nothing_outside_the_upload_package_imports_its_internals() -> None:
    outside = [i for i in IMPORTS if _in(i.target, "sidecar.host.upload")
               and not _in(i.module, "sidecar.host.upload")]
    internal = [_where(i) for i in outside if i.target not in UPLOAD_PUBLIC]
    settings = [_where(i) for i in outside
                if i.module in SETTINGS_MODULES and i.target not in SETTINGS_FROM_UPLOAD]
    assert internal == [] and settings == []


def test_no_module_imports_another_modules_private_name() -> None:
    broken = [
        f"{_where(i)} ({name})"
        for i in IMPORTS
        if _project(i.target) and i.target != i.module
        for name in i.names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert broken == []


def test_no_lazy_re_exports() -> None:
    """A module-level ``__getattr__`` that hands out another module's names hides a cycle."""
    broken = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                lazy = [i for i in _imports(module, path) if i.line > node.lineno
                        and i.line <= (node.end_lineno or node.lineno) and _project(i.target)]
                if lazy:
                    broken.append(f"{module}:{node.lineno}")
    assert broken == []


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state:
                found = walk(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = walk(node)
            if found:
                return found
    return []


def _owner(target: str) -> str:
    """The module that runs for an import: the target itself, else its package."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {}
    for found in IMPORTS:
        owner = _owner(found.target)
        if owner and owner != found.module and not _in(found.module, owner):
            graph.setdefault(found.module, set()).add(owner)
    assert _cycle(graph) == []


@pytest.mark.parametrize(
    "graph, cycle",
    [
        ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(graph: dict[str, set[str]], cycle: list[str]) -> None:
    assert _cycle(graph) == cycle


def test_the_import_reader_sees_lazy_imports() -> None:
    # `esi-sidecar serve` imports the daemon inside a function: the reader must see it as lazy.
    lazy = [i for i in IMPORTS
            if i.module == "sidecar.cli.commands" and i.target == "sidecar.host.daemon"]
    assert lazy and not any(i.top_level for i in lazy)


# The save rule's table and its estimates: pure (issue 37; docs/architecture.md).
RULE_MODULES = ("sidecar.train.rule", "sidecar.train.estimates", "sidecar.train.deadlines")


def test_the_rule_and_its_estimates_import_only_the_stdlib_shared_and_each_other() -> None:
    assert all(module in MODULES for module in RULE_MODULES)
    broken = [
        _where(i) for i in IMPORTS
        if i.module in RULE_MODULES
        if not (i.target in RULE_MODULES or i.target in SHARED
                or (not _project(i.target) and i.target.split(".")[0] in STDLIB))
    ]
    assert broken == []


def test_the_rule_reads_no_clock() -> None:
    clocks = {"time", "datetime", "os", "socket", "threading", "subprocess", "random"}
    found = [_where(i) for i in IMPORTS
             if i.module in RULE_MODULES and i.target.split(".")[0] in clocks]
    assert found == []
