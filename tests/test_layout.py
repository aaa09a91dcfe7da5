"""The package's layers, checked from the imports in its source: `decode/`'s layers import only those
below them, no module imports one of a layer above, the decode worker stays free of torch, and no
private name crosses a package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import gpufeed

SRC = Path(gpufeed.__file__).parent
DECODE_LAYERS = {"asks": 0, "base": 0, "tuning": 0, "codecs": 1, "pool": 2, "scheduling": 3}


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every `import` and `from ... import` in `path` (function bodies included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return found


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["gpufeed", "decode"] or len(parts) < 3:
        return None
    return DECODE_LAYERS.get(parts[2])


def test_decode_layers_import_only_those_below_them():
    wrong = []
    for path in (SRC / "decode").rglob("*.py"):
        mine = _layer("gpufeed." + ".".join(path.relative_to(SRC).with_suffix("").parts))
        for module, names in _imports(path):
            targets = [module] + [f"{module}.{n}" for n in names]
            for target in targets:
                theirs = _layer(target)
                if mine is not None and theirs is not None and theirs > mine:
                    wrong.append(f"{path.relative_to(SRC)} imports {target}")
    assert not wrong, wrong


def test_no_private_name_crosses_a_package():
    wrong = []
    for path in SRC.rglob("*.py"):
        package = path.relative_to(SRC).parts[0]
        for module, names in _imports(path):
            if module.startswith("gpufeed.") and module.split(".")[1] != package:
                wrong += [f"{path.relative_to(SRC)}: {module}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
    assert not wrong, wrong


def test_the_decode_worker_imports_no_torch():
    code = ("import sys; import gpufeed.decode.pool.worker, gpufeed.decode.codecs.pixels, gpufeed.decode.asks; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_the_read_path_imports_nothing_of_the_write_path():
    """The Loader reads sources (a folder in place) through `gpufeed.sources`, as packing does; it never
    imports packing."""
    wrong = [f"{path.relative_to(SRC)} imports {module}" for path in (SRC / "loader").rglob("*.py")
             for module, _ in _imports(path) if module.startswith("gpufeed.packing")]
    assert not wrong, wrong


STORE_KINDS = {"Store", "ShardedStore", "RemoteStore", "FolderStore"}


def test_the_loader_tells_no_store_kind_apart_outside_its_inputs():
    """The Loader composes an `Input` (`loader/inputs/`): only `open_input` and the inputs test what
    kind of store they have (the Loader checked the kind 13 times, over loader.py and tiers.py)."""
    wrong = []
    for path in (SRC / "loader").rglob("*.py"):
        if "inputs" in path.relative_to(SRC).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                named = {k.id for k in kinds if isinstance(k, ast.Name)} & STORE_KINDS
                wrong += [f"{path.relative_to(SRC)}:{node.lineno} isinstance(..., {name})" for name in sorted(named)]
    assert not wrong, wrong


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own: `gpufeed.store`)."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports (anywhere in it, function bodies included): a name imported
    from a package goes to the module the package takes it from (`__init__`'s re-exports and lazy
    `_EXPORTS`), so a package that re-exports is no circle by itself."""
    exports: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        if path.name == "__init__.py":
            found = {}
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    found |= {a.asname or a.name: node.module for a in node.names}
                if isinstance(node, ast.Dict):  # a lazy package's {name: "module"}
                    found |= {k.value: v.value for k, v in zip(node.keys, node.values)
                              if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)
                              and isinstance(v.value, str) and v.value in modules}
            exports[name] = found
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for module, names in _imports(path):
            for target in [f"{module}.{n}" if f"{module}.{n}" in modules else exports.get(module, {}).get(n, module)
                           for n in names] or [module]:
                if target in modules and target != name:
                    edges[name].add(target)
    return edges


def test_no_import_circle():
    """No module imports, however indirectly, a module that imports it (lazy imports in function bodies
    count: they only hide a circle). A circle is two modules that can't be understood apart."""
    edges = _edges(_modules())
    circles = []
    for start in sorted(edges):
        seen, todo = set(), [(start, (start,))]
        while todo:
            here, path = todo.pop()
            for nxt in sorted(edges[here]):
                if nxt == start:
                    circles.append(" -> ".join((*path, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    todo.append((nxt, (*path, nxt)))
            if circles and circles[-1].startswith(start):
                break
    assert not circles, circles


def test_no_two_packages_import_each_other():
    """The package's folders (its stages: `store`, `sources`, `decode`, `loader`, ...) import one another
    one way only: a folder that imports another is not imported back by it, through any of their
    modules (a circle between two folders, each one-way between modules, still ties them together)."""
    def folder(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and (SRC / parts[1]).is_dir() else None

    uses: dict[str, dict[str, str]] = {}
    for name, targets in _edges(_modules()).items():
        for target in targets:
            a, b = folder(name), folder(target)
            if a and b and a != b:
                uses.setdefault(a, {}).setdefault(b, f"{name} -> {target}")
    both = [f"{uses[a][b]}; {uses[b][a]}" for a in sorted(uses) for b in sorted(uses[a]) if a < b and a in uses.get(b, {})]
    assert not both, both


def test_no_module_imports_the_package_it_is_part_of():
    """Only the top-level API imports `gpufeed` itself; a module inside it that did (to find a path, a
    version) would run back up through everything the package imports."""
    wrong = [str(path.relative_to(SRC)) for name, path in _modules().items() if name != "gpufeed"
             for module, _ in _imports(path) if module == "gpufeed"]
    assert not wrong, wrong


def test_every_module_logs_through_the_logger_that_escapes_file_names():
    """`gpufeed.logs.logger` escapes a file name's undecodable bytes, which a strict handler can't write;
    a module that called `logging.getLogger` itself would lose such messages. Only the CLI, which sets
    up the program's handler, names loggers by hand."""
    wrong = [str(path.relative_to(SRC)) for name, path in _modules().items()
             if name not in ("gpufeed.logs", "gpufeed.cli") and "getLogger(" in path.read_text()]
    assert not wrong, wrong
