"""The import structure holds: layers import only downward, no module circles, few imports inside functions.

The layers (README "Layout"), bottom to top: kernels -> model building blocks -> engine ->
prompt inputs -> model families -> runtime -> front ends. Imports are read from the source
(the AST), including those inside functions, so a circle cannot hide in a function body.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("omni_jax", "kernels_pallas", "kernels_cpu", "conversion")

# Bottom to top; a module belongs to the layer of its longest matching prefix.
LAYERS = (
    ("kernels", ("kernels_pallas", "kernels_cpu")),
    ("building blocks", ("omni_jax.models.layers", "omni_jax.errors", "omni_jax.paths")),
    ("engine", ("omni_jax.engine",)),
    ("inputs", ("omni_jax.inputs",)),
    ("families", ("omni_jax.models", "omni_jax.checkpoint", "omni_jax.config")),
    ("runtime", ("omni_jax.runtime",)),
    ("front ends", ("omni_jax", "omni_jax.api", "omni_jax.cli", "omni_jax.demo", "omni_jax.server",
                    "omni_jax.gpu", "conversion")),
)

MAX_FUNCTION_IMPORTS = 10


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _targets(module: str, node: ast.AST) -> list[str]:
    """Project modules an import statement names (`from pkg import mod` counts as pkg.mod)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".")
            if not MODULES[module].name == "__init__.py":
                base = base[:-1]
            base = base[: len(base) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]
    out = []
    for name in names:
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES and name != module:
            out.append(name)
    return out


def _imports() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """(module -> imported project modules, [(module, line, reason comment) of imports inside functions])."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    inner = []
    for module, path in MODULES.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        in_function = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                in_function.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = _targets(module, node)
            graph[module].update(targets)
            if targets and id(node) in in_function:
                above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                inner.append((module, node.lineno, above if above.startswith("#") else ""))
    return graph, inner


GRAPH, FUNCTION_IMPORTS = _imports()


def _layer(module: str) -> int:
    best, level = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    assert level is not None, f"{module} is in no layer: add it to LAYERS"
    return level


def test_every_module_is_in_a_layer():
    for m in MODULES:
        _layer(m)


def _upward(graph) -> list[str]:
    return [f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})"
            for m, targets in graph.items() for t in sorted(targets) if _layer(t) > _layer(m)]


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_layers_import_only_downward():
    upward = _upward(GRAPH)
    assert not upward, "\n".join(upward)


def test_engine_knows_no_model_family():
    family = [f"{m} imports {t}" for m, targets in GRAPH.items() if m.startswith("omni_jax.engine")
              for t in targets if t.startswith("omni_jax.models.") and not t.startswith("omni_jax.models.layers")]
    assert not family, "\n".join(family)


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_few_imports_inside_functions_each_with_a_reason():
    assert len(FUNCTION_IMPORTS) <= MAX_FUNCTION_IMPORTS, FUNCTION_IMPORTS
    unexplained = [f"{m}:{line}" for m, line, why in FUNCTION_IMPORTS if not why]
    assert not unexplained, f"imports inside functions need a '# why' comment on the line above: {unexplained}"


def test_the_checks_catch_a_violation():
    """The checks are not vacuous: an engine module importing a family, and a circle, are found."""
    graph = {m: set(t) for m, t in GRAPH.items()}
    graph["omni_jax.engine.runner"].add("omni_jax.models.qwen2_5_omni.stages")
    assert _upward(graph) == ["omni_jax.engine.runner (engine) imports omni_jax.models.qwen2_5_omni.stages (families)"]
    graph = {m: set(t) for m, t in GRAPH.items()}
    graph["omni_jax.engine.buckets"].add("omni_jax.engine.runner")
    assert _cycles(graph) == [["omni_jax.engine.buckets", "omni_jax.engine.runner"]]


def test_benchmarks_import_no_circle():
    """Benchmark scripts import each other as top-level modules: no circle among them either."""
    bench = ROOT / "benchmarks"
    names = {p.stem for p in bench.glob("*.py")}
    graph = {}
    for p in bench.glob("*.py"):
        found = set()
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Import):
                found.update(a.name for a in n.names if a.name in names)
            elif isinstance(n, ast.ImportFrom) and not n.level and n.module in names:
                found.add(n.module)
        graph[p.stem] = found - {p.stem}
    assert len(graph) > 3 and _cycles(graph) == []


def test_readme_request_path_names_real_files_and_at_most_20():
    """README's Layout lists the files one text request crosses: they exist, their number is the one
    it states, and it stays within 20 (a module split off the path has to be a real gain). It was 14
    until five jobs left the three largest modules on the path for modules named for them: the
    scheduler's KV blocks, the sampler's parameters and per-step inputs, the orchestrator's outputs
    and stage-process handle; then Qwen2.5-Omni's prompt rules left the shared prompt processor for
    its family's folder."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("The path of one text request"):text.index("A speech request goes")]
    stated = int(re.search(r"through (\d+) files", section).group(1))
    files = set()
    for name in re.findall(r"`([\w/]+(?:\.py|/))`", section):
        path = ROOT / name if name.startswith("kernels_") else ROOT / "omni_jax" / name
        assert path.exists(), f"README's request path names {name}, which does not exist"
        files.add(name)
    # The kernels are the path's end: the backend's package counts once (GPU or CPU).
    count = len(files) - (("kernels_pallas/" in files) and ("kernels_cpu/" in files))
    assert count == stated <= 20, sorted(files)
