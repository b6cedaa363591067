"""Dependencies point one way: the runtime (sparsejax's decode path, its models and kernels, and
the file reader `artifacts`) never imports the jobs that fit or measure things, nor `train/`,
nor their heavy libraries; and no module of the package imports itself through a cycle."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the jobs: calibration, gate training, pretraining, eval, demo, the command line
JOBS = ("sparsejax.__main__", "sparsejax.cli", "sparsejax.evaluation", "sparsejax.demo",
        "sparsejax.train.calibrate", "sparsejax.train.gates", "sparsejax.train.pretrain",
        "sparsejax.train.passkey")
HEAVY = ("optax", "orbax", "matplotlib")
# folder -> import name of the runtime's files
RUNTIME = {"sparsejax": "sparsejax", "models": "sparsejax.models",
           "pallas_kernels": "sparsejax.pallas_kernels"}
JOB_FILES = {"__main__.py", "cli.py", "evaluation.py", "demo.py"}


def _is_job(name: str) -> bool:
    return any(name == job or name.startswith(job + ".") for job in JOBS)


def _import_statements(path: Path, package: str):
    """(module, names imported from it or None) for every import in `path`, at any depth of
    its code, relative imports made absolute from `package`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            yield base, [a.name for a in node.names]


def _imports(path: Path, package: str) -> set[str]:
    """Every module `path` imports, at any depth of its code, as absolute names."""
    names = set()
    for base, imported in _import_statements(path, package):
        names.add(base)
        names.update(f"{base}.{n}" for n in imported or ())
    return names


def runtime_files():
    """Every file of the runtime, subpackages included, with the package it sits in."""
    for folder, package in RUNTIME.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            inner = path.parent.relative_to(ROOT / folder).parts
            if inner or folder != "sparsejax" or path.name not in JOB_FILES:
                yield path, ".".join((package, *inner))


def test_static_check_finds_a_job_import(tmp_path):
    """Negative control: the check sees imports inside functions and relative imports."""
    src = tmp_path / "bad.py"
    src.write_text("def f():\n    from .train import gates\n    import sparsejax.evaluation\n")
    found = {n for n in _imports(src, "sparsejax") if _is_job(n)}
    assert found == {"sparsejax.train.gates", "sparsejax.evaluation"}


def test_no_runtime_module_imports_a_job():
    files = list(runtime_files())
    assert {p.name for p, _ in files} >= {"artifacts.py", "methods.py", "generate.py",
                                          "layers.py", "decoder.py", "sparse_attention.py",
                                          "sampled.py"}
    bad = {f"{p.relative_to(ROOT)}: {n}" for p, pkg in files for n in _imports(p, pkg)
           if _is_job(n) or n.startswith("sparsejax.train")}
    assert not bad


@pytest.mark.parametrize("module", ["sparsejax", "sparsejax.methods", "sparsejax.generate"])
def test_importing_the_runtime_loads_no_job(module):
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    loaded = json.loads(out.stdout.splitlines()[-1])
    assert module in loaded and "jax" in loaded      # it did import the runtime
    assert not [m for m in loaded if _is_job(m) or m.split(".")[0] in HEAVY]


def test_training_data_loads_no_optimizer():
    code = ("import json, sys; from sparsejax.train import data; "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    loaded = json.loads(out.stdout.splitlines()[-1])
    assert "sparsejax.train.data" in loaded
    assert not [m for m in loaded if _is_job(m) or m.split(".")[0] in HEAVY]


# ---- no import cycles ------------------------------------------------------------------------
PACKAGE_DIRS = {"sparsejax": "sparsejax", "models": "sparsejax.models",
                "pallas_kernels": "sparsejax.pallas_kernels", "train": "sparsejax.train"}


def _package_modules() -> dict[str, tuple[Path, str]]:
    """Every module of the package -> (its file, the package its relative imports start from)."""
    modules = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                name = ".".join((package,) + parts[:-1])
                modules[name] = (path, name)
            else:
                name = ".".join((package,) + parts)
                modules[name] = (path, name.rsplit(".", 1)[0])
    return modules


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports at any depth of its code. `from X import y`
    points at X.y when that is a module, else at X."""
    modules = _package_modules()
    graph = {}
    for name, (path, package) in modules.items():
        edges = set()
        for base, imported in _import_statements(path, package):
            if imported is None:
                edges.add(base)
            for n in imported or ():
                edges.add(f"{base}.{n}" if f"{base}.{n}" in modules else base)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_cycle_check_finds_a_cycle():
    """Negative control: a two-module loop and a three-module loop are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(import_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert {"sparsejax.cache", "sparsejax.sharding", "sparsejax.cli",
            "sparsejax.pallas_kernels.common"} <= set(graph)
    assert "sparsejax.arguments" in graph["sparsejax.cli"]       # it does see the edges
    assert not import_cycles(graph)
