"""Structure rules that keep the code base honest: collectives in one package, the layers, file and
function sizes."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_only_comm_calls_torch_distributed() -> None:
    # Collectives everywhere else go through engine/comm/, so bytes are counted and a faster
    # gloo implementation replaces them in one place.
    pattern = re.compile(r"torch\.distributed|import torch\.distributed|from torch import distributed")
    offenders = []
    comm = ROOT / "engine" / "comm"
    for path in sorted((ROOT / "engine").rglob("*.py")):
        if path.is_relative_to(comm):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "torch.distributed used outside engine/comm/:\n" + "\n".join(offenders)


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.*?)```", readme, re.S)
    assert block, "README.md must show the test command after a <!-- test-command --> marker"
    command = block.group(1).strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci, f".ci/run must run the README's test command verbatim:\n{command}"


# ----------------------------------------------------------------------------------- import graph
# Every `import engine...` / `from engine... import` in engine/, module-level or inside a function
# (a lazy import is still a dependency), resolved to the module it names: `from engine.zero import
# owners` is engine.zero.owners, `from engine.comm import get_rank` is engine.comm (the package's
# __init__). Imports under `if TYPE_CHECKING:` never run, so they cannot form an import cycle and the
# cycle rule exempts them; the layer rule does not: a type-only import of a higher layer is still a lower
# module that knows a higher one (precision/ naming a zero/ type was one).
ENGINE = ROOT / "engine"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ENGINE.rglob("*.py"))}
PACKAGES = {_module_name(p) for p in ENGINE.rglob("__init__.py")}


def _resolve(name: str) -> str:
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: pathlib.Path, *, type_only: bool) -> set[str]:
    """The modules `path` imports; with type_only, those under `if TYPE_CHECKING:` too."""
    tree = ast.parse(path.read_text())
    exempt = (
        set()
        if type_only
        else {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and _is_type_checking(block)
            for stmt in block.body
            for n in ast.walk(stmt)
        }
    )
    found = set()
    for node in ast.walk(tree):
        if id(node) in exempt:
            continue
        if isinstance(node, ast.Import):
            found |= {_resolve(a.name) for a in node.names if a.name.split(".")[0] == "engine"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "engine":
            assert node.module is not None
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else _resolve(node.module))
    return found


IMPORTS = {name: _imports(path, type_only=False) - {name} for name, path in MODULES.items()}
"""What each module imports when it runs (the cycle rule)."""
ALL_IMPORTS = {name: _imports(path, type_only=True) - {name} for name, path in MODULES.items()}
"""Runtime and type-only imports (the layer rule)."""


def _cycle() -> list[str] | None:
    """One import cycle between modules of engine/, as the path around it, or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        for imported in sorted(IMPORTS[name]):
            found = visit(imported, [*path, name])
            if found:
                return found
        done.add(name)
        return None

    for name in sorted(MODULES):
        found = visit(name, [])
        if found:
            return found
    return None


def test_no_import_cycle_between_modules() -> None:
    cycle = _cycle()
    assert cycle is None, (
        "import cycle in engine/ (move the piece both sides need into the lower module, "
        "or pass it in as an argument): " + " -> ".join(cycle or [])
    )


# ------------------------------------------------------------------------------------ layer order
# Every package of engine/ (sub-packages too) and every top-level module, lowest layer first. A module
# may import from its own package and from lower layers only: never from a higher layer nor from another
# package of its own layer (those stay independent). A package and its sub-package in the same layer are
# one unit (checkpoint/ and checkpoint/deepspeed_format/ use each other's modules; the cycle test still
# holds). A package's __init__ may re-export its own sub-packages (engine.zero's Init, set_z3_leaf_modules).
LAYERS: list[tuple[str, ...]] = [
    # imports nothing of engine/
    ("engine.accelerator", "engine.config", "engine.ops", "engine.unsupported"),
    # the logger and monitors, flops profiling, optimizers and schedules, process groups and collectives
    ("engine.comm", "engine.monitor", "engine.optim", "engine.profiling"),
    # tensor-parallel groups and layers; dtypes and loss scaling; NVMe offload (the swap files and the
    # swapped optimizer step), which every stage holds as its offload tier or not at all
    ("engine.offload", "engine.parallel", "engine.precision"),
    # activation checkpointing; what the ZeRO stages share (layout, flat groups, the master step, zero.Init)
    ("engine.activation_checkpointing", "engine.zero"),
    # the stages; sequence parallelism's layers (attention all-to-alls, the batch adapter, tiled compute,
    # whose recompute replays the forward as activation checkpointing does)
    ("engine.sequence", "engine.zero.flat", "engine.zero.stage3"),
    # sharded checkpoints of a stage's records; the memory estimator; the environment report
    ("engine.checkpoint", "engine.checkpoint.deepspeed_format", "engine.estimate", "engine.report"),
    # the Engine and its parts: the accumulation window, its save/load methods, its accessors, the
    # optimizer it returns
    ("engine.runtime",),
    ("engine.initialize",),
    # the public surface (engine/__init__.py)
    ("engine",),
]
LAYER = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def _unit(module: str) -> str:
    """A module's package, or the module itself at engine/'s top level."""
    if module in PACKAGES:
        return module
    parent = module.rpartition(".")[0]
    return module if parent == "engine" else parent


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def test_every_package_and_top_level_module_has_a_layer() -> None:
    units = {_unit(m) for m in MODULES}
    missing = sorted(units - set(LAYER))
    assert not missing, f"not in tests/test_layering.py's LAYERS (add each where its imports put it): {missing}"
    stale = sorted(set(LAYER) - units)
    assert not stale, f"LAYERS names what engine/ no longer has: {stale}"


def test_no_module_imports_from_a_higher_layer() -> None:
    offenders = []
    for module, imported in sorted(ALL_IMPORTS.items()):
        mine = _unit(module)
        for target in sorted(imported):
            theirs = _unit(target)
            if module in PACKAGES and target.startswith(module + "."):
                continue  # a package's __init__ re-exporting its own modules
            if mine not in LAYER or theirs not in LAYER:
                continue  # named by test_every_package_and_top_level_module_has_a_layer
            if LAYER[theirs] < LAYER[mine] or (LAYER[theirs] == LAYER[mine] and _related(mine, theirs)):
                continue
            offenders.append(
                f"{module} ({mine}, layer {LAYER[mine]}) imports {target} ({theirs}, layer {LAYER[theirs]})"
            )
    assert not offenders, "imports against tests/test_layering.py's LAYERS:\n" + "\n".join(offenders)


# ----------------------------------------------------------------------------------- file and package
MAX_LINES = 450
MAX_FUNCTION_LINES = 80


def test_no_file_in_engine_over_450_lines() -> None:
    # A file a reader can hold in one sitting (the small-file codebases we learn from keep theirs under 300
    # lines; PyTorch's FSDP2 under 1,000).
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in sorted(ENGINE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"files in engine/ over {MAX_LINES} lines (split along a real seam):\n" + "\n".join(long)


def test_every_package_docstring_says_what_it_owns() -> None:
    silent = [
        str(p.relative_to(ROOT))
        for p in sorted(ENGINE.rglob("__init__.py"))
        if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()
    ]
    assert not silent, "packages whose __init__.py has no docstring saying what the package owns: " + ", ".join(silent)


def test_no_function_in_engine_over_80_lines() -> None:
    # A function that reads in one screen; a longer one hides phases that want names of their own.
    long = [
        f"{p.relative_to(ROOT)}:{node.lineno}: {node.name} is {n} lines"
        for p in sorted(ENGINE.rglob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (n := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions in engine/ over {MAX_FUNCTION_LINES} lines (split into named phases):\n" + "\n".join(
        long
    )


OUTSIDE = re.compile(r"\.\./shared\b|/work/|\bSTYLE\.md\b|\bDESIGN\.md\b|/root/")
"""Paths of one machine or of folders beside the checkout: a clone has none of them."""


def test_no_path_outside_the_repository_is_named() -> None:
    # A fresh clone is all a reader has: the project says what it needs in its own files and words.
    import subprocess

    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for name in listed:
        path = ROOT / name
        if (
            path.suffix not in {".py", ".md", ".json", ".toml", ".cfg", ".txt", ".sh", ".yaml", ".yml"}
            or not path.is_file()
        ):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line) and "OUTSIDE = re.compile" not in line:
                offenders.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not offenders, "paths outside the repository (say it in the project's own words):\n" + "\n".join(offenders)
