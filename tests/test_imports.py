"""Imports: the package's modules form no cycle, and every import deferred into a function says why."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "fsdp_peft"
LAZY_REASON = re.compile(r"# lazy: \S")  # e.g. ``# lazy: ls/cp must not import torch``


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(tree: ast.AST, in_function: bool = False):
    """``(node, inside a function)`` for every import statement, in source order."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        yield from _imports(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _imported_modules(node: ast.Import | ast.ImportFrom, importer: str) -> set[str]:
    """The package modules an import statement loads: the named ones and the packages above them, whose
    ``__init__`` runs first (except the packages the importer is inside, which are loading already)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = importer if MODULES[importer].name == "__init__.py" else importer.rpartition(".")[0]
            package = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
            base = f"{package}.{base}" if base else package
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    loaded = set()
    for name in names:
        while name and name not in MODULES:  # ``import fsdp_peft.x.y`` of an attribute: its module
            name = name.rpartition(".")[0]
        while name:
            if name != importer and not importer.startswith(f"{name}."):
                loaded.add(name)
            name = name.rpartition(".")[0]
    return loaded


def import_graph() -> dict[str, set[str]]:
    """``{module: package modules it imports}``, at module top or inside functions alike."""
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = set().union(*(_imported_modules(node, name) for node, _ in _imports(tree)))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path around each cycle found by a depth-first walk (empty when there is none)."""
    found, state = [], {}  # state: 1 while on the walk's path, 2 once finished
    path: list[str] = []

    def walk(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                found.append(path[path.index(target) :] + [target])
            elif target not in state:
                walk(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module)
    return found


def local_imports() -> list[tuple[str, int, str]]:
    """``(file, line, source)`` of every import statement inside a function body."""
    found = []
    for path in MODULES.values():
        text = path.read_text()
        lines = text.splitlines()
        for node, in_function in _imports(ast.parse(text, filename=str(path))):
            if in_function:
                source = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                found.append((str(path.relative_to(REPO)), node.lineno, source))
    return found


def test_the_graph_sees_imports_inside_functions_and_the_packages_they_load():
    graph = import_graph()
    assert "fsdp_peft.tools.plan" in graph["fsdp_peft.cli"]  # imported inside `_plan` only
    # its import of a data submodule runs the package's __init__
    assert "fsdp_peft.data" in graph["fsdp_peft.procedures.sft"]
    assert "fsdp_peft.data.sources" in graph["fsdp_peft.data.formats"]
    assert "fsdp_peft.data" not in graph["fsdp_peft.data.formats"]  # its own package is loading already
    outside = ast.parse("from fsdp_peft.data.cache import load_data").body[0]
    assert _imported_modules(outside, "fsdp_peft.recipe") == {"fsdp_peft.data.cache", "fsdp_peft.data"}
    relative = ast.parse("from .sources import Source").body[0]
    assert _imported_modules(relative, "fsdp_peft.data.formats") == {"fsdp_peft.data.sources"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def layers(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's import layer: 0 for one that imports no package module, else one above the highest it imports."""
    found: dict[str, int] = {}

    def layer(module: str) -> int:
        if module not in found:
            found[module] = 1 + max((layer(target) for target in graph[module]), default=-1)
        return found[module]

    for module in graph:
        layer(module)
    return found


def test_layers_count_from_the_modules_that_import_none():
    assert layers({"a": set(), "b": {"a"}, "c": {"a", "b"}, "d": set()}) == {"a": 0, "b": 1, "c": 2, "d": 0}


def test_the_package_stands_on_at_most_13_import_layers():
    graph = import_graph()
    layer = layers(graph)
    module = max(layer, key=layer.get)
    chain = [module]
    while graph[chain[-1]]:
        chain.append(max(graph[chain[-1]], key=layer.get))
    print(f"{layer[module] + 1} layers: " + " <- ".join(chain))
    assert layer[module] + 1 <= 13, " <- ".join(f"{m} ({layer[m]})" for m in chain)


PROCEDURES = (
    "fsdp_peft.procedures.sft",
    "fsdp_peft.procedures.vision_sft",
    "fsdp_peft.procedures.preference",
    "fsdp_peft.procedures.rl",
)  # `fsdp_peft.procedures.procedure.Procedure` values


def test_the_procedures_are_siblings_that_one_skeleton_calls():
    graph = import_graph()
    for procedure in PROCEDURES:
        assert not graph[procedure] & {*PROCEDURES, "fsdp_peft.recipe"}, procedure
    skeletons = [
        (name, node.lineno)
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "run_recipe"
    ]
    assert skeletons == [("fsdp_peft.recipe", skeletons[0][1])], skeletons


def test_the_package_modules_import_each_other_without_a_cycle():
    found = cycles(import_graph())
    assert found == [], "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_every_import_inside_a_function_says_why_it_is_deferred():
    found = local_imports()
    print(f"{len(found)} imports inside functions")
    unexplained = [f"{file}:{line}: {source.strip()}" for file, line, source in found if not LAZY_REASON.search(source)]
    assert not unexplained, "imports inside functions without a '# lazy: <why>' comment:\n" + "\n".join(unexplained)


def test_the_model_record_is_the_only_state_set_on_models_by_name():
    """What the model build decides travels in `fsdp_peft.model.model_record.ModelRecord`: outside that module no
    ``setattr``/``delattr`` with a name, and no ``_fsdp_peft_*`` attribute assigned (the compat module patches
    upstream classes, and is the one other place allowed to)."""
    found = []
    for name, path in MODULES.items():
        if name == "fsdp_peft.model.model_record" or name.startswith("fsdp_peft.core._compat."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            called = isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr")
            assigned = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            if called or (assigned and node.attr.startswith("_fsdp_peft")):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []


# The rooms of the package, lowest first: a module imports only from its own room and the rooms before it
# (README's layout table lists them top down). Outside every room and above them all: the recipes' skeleton, the
# ``fsdp-peft`` command (both entry points, which hand a procedure down to the tools), and the package's own
# __init__ (which every import of a module runs first, so an import of it is no arrow).
ROOMS = ("core", "settings", "model", "data", "parallel", "tools", "procedures")
ABOVE_THE_ROOMS = {"fsdp_peft", "fsdp_peft.recipe", "fsdp_peft.cli"}


def room_of(module: str) -> int:
    """The index in `ROOMS` of a package module's room (past the last for the modules above them)."""
    parts = module.split(".")
    if module in ABOVE_THE_ROOMS:
        return len(ROOMS)
    return ROOMS.index(parts[1]) if len(parts) > 1 and parts[1] in ROOMS else -1


def test_every_module_lies_in_a_room_and_imports_no_room_above_its_own():
    graph = import_graph()
    homeless = [m for m in graph if room_of(m) < 0]
    assert not homeless, f"modules outside the rooms {ROOMS}: {homeless}"
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if target != "fsdp_peft" and room_of(target) > room_of(module)
    )
    assert not upward, "imports of a higher room:\n" + "\n".join(upward)
    assert room_of("fsdp_peft.model.tiny") == 2 and room_of("fsdp_peft.model") == 2  # the package's own __init__ too


def test_every_room_says_what_it_owns_and_names_each_of_its_modules():
    """A room's ``__init__`` docstring is its map (README's layout table names the rooms): every module and
    subpackage in it is named there, as `name` or `fsdp_peft.<room>.name`."""
    for room in ROOMS:
        docstring = ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text())) or ""
        members = [p.stem for p in (PACKAGE / room).glob("*.py") if p.name != "__init__.py"]
        members += [p.name for p in (PACKAGE / room).iterdir() if (p / "__init__.py").is_file()]
        unnamed = [name for name in members if not re.search(rf"`(fsdp_peft\.{room}\.)?{name}\b", docstring)]
        assert docstring and not unnamed, f"fsdp_peft/{room}/__init__.py does not name: {unnamed}"


TOP_LEVEL_TESTS = ["test_cli.py", "test_docs.py", "test_imports.py", "test_recipes_catalog.py", "test_recipes_fsdp.py"]


def test_the_tests_mirror_the_rooms():
    """``tests/<room>/`` for every room, and at the top only the tests of the whole package (docs/tests.md); a test
    module imports another test module only within its own folder (pytest puts a folder on the path only when it
    imports a test from it)."""
    tests = REPO / "tests"
    assert all((tests / room).is_dir() and any((tests / room).glob("test_*.py")) for room in ROOMS)
    assert sorted(path.name for path in tests.glob("test_*.py")) == TOP_LEVEL_TESTS
    modules = {path.stem: path.parent for path in tests.rglob("test_*.py")}
    crossing = [
        f"{path.relative_to(REPO)} imports {node.module}"
        for path in tests.rglob("test_*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and node.module in modules
        and modules[node.module] not in (path.parent, tests)
    ]
    assert not crossing, crossing
