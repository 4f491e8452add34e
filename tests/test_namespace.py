"""The distribution installs under one namespace, ``mlx_serving``: an application's own
``models``, ``serving`` and ``tokenization`` modules cannot shadow the runtime's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import mlx_serving

_APP = {
    "models.py": "raise ImportError('the application models.py was imported by the runtime')\n",
    "serving.py": "raise ImportError('the application serving.py was imported by the runtime')\n",
    "tokenization.py": "raise ImportError('the application tokenization.py was imported by the runtime')\n",
}


def test_public_names_are_reexported():
    from mlx_serving import serving

    for name in serving.__all__:
        assert getattr(mlx_serving, name) is getattr(serving, name)
    assert mlx_serving.text_generation.from_mlx4bit is not None
    assert set(mlx_serving.__all__) >= {"Serving", "ServingPool", "Batch", "text_generation", "default_checkpoint"}


def test_an_application_with_its_own_models_and_serving_modules(tmp_path: Path, tiny_ckpt: Path):
    app = tmp_path / "app"
    app.mkdir()
    for name, text in _APP.items():
        (app / name).write_text(text)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(app)!r})
        from mlx_serving import Serving, text_generation
        serving = text_generation.from_mlx4bit({str(tiny_ckpt)!r}, max_new_tokens=3, max_len=64, max_batch=2)
        result = Serving.run(serving, "hello")["results"][0]
        assert result["num_tokens"] == 3, result
        with Serving.start(serving) as handle:
            assert Serving.batched_run(handle, "hello")["results"][0]["generated_text"] == result["generated_text"]
        loaded = [m for m in sys.modules if m in ("models", "serving", "tokenization")]
        assert not loaded, loaded
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=app, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


_SRC = Path(mlx_serving.__file__).parent
#: Each layer and the layers it may import (docs/architecture.md): imports run down this list only.
_MAY_IMPORT = {
    "tokenization": set(),
    "serving": set(),
    "models": {"serving", "tokenization"},
    "server": {"serving", "models", "tokenization"},
}


def _imported_layers(path: Path) -> set[str]:
    """The package's top-level layers (``serving``, ``models``, ...) a module imports, relative or
    absolute, lazily inside functions included."""
    import ast

    parts = path.relative_to(_SRC).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                target = [*base, *(node.module or "").split(".")] if node.module else base
                names = [target + [alias.name] for alias in node.names] if not target else [target]
            else:
                names = [node.module.split(".")[1:]] if (node.module or "").startswith("mlx_serving.") else []
            found.update(n[0] for n in names if n and n[0])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("mlx_serving."))
    return found


def test_imports_run_down_the_layers_only():
    """serving/ and tokenization/ import no other layer, models/ neither server/ nor the CLI, and
    nothing imports the CLI: the folder layout is the import graph."""
    wrong = []
    for path in sorted(_SRC.rglob("*.py")):
        layer = path.relative_to(_SRC).parts[0]
        if layer not in _MAY_IMPORT:
            continue  # the package's face (__init__.py, __main__.py) and the CLI sit on top
        for other in _imported_layers(path) - _MAY_IMPORT[layer] - {layer, "_version", "_paths"}:
            wrong.append(f"{path.relative_to(_SRC)} imports {other}")
    assert not wrong, wrong


def _module_names() -> dict[str, Path]:
    """Every module of the package by dotted name below ``mlx_serving`` (a package by its ``__init__``)."""
    out = {}
    for path in _SRC.rglob("*.py"):
        parts = path.relative_to(_SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports: relative or absolute, lazy (inside functions) and
    ``TYPE_CHECKING`` imports included (a dodged cycle is still a cycle)."""
    import ast

    modules = _module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[list[str]] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1] if node.level > 1 else package
                    mod = [*base, *(node.module.split(".") if node.module else [])]
                elif (node.module or "").startswith("mlx_serving."):
                    mod = node.module.split(".")[1:]
                else:
                    continue
                # ``from X import name``: the submodule X.name where there is one, else X itself
                targets = [[*mod, a.name] if ".".join([*mod, a.name]) in modules else mod for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".")[1:] for a in node.names if a.name.startswith("mlx_serving.")]
            for t in targets:  # the most specific module the import names
                for k in range(len(t), 0, -1):
                    if ".".join(t[:k]) in modules:
                        edges.add(".".join(t[:k]))
                        break
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    """The import graph of src/ (lazy and TYPE_CHECKING imports included) has no cycle."""
    assert _cycles(_import_graph()) == []


def test_the_decoder_sits_below_the_engine_and_neither_is_in_an_import_cycle():
    """models/decoder imports nothing of the engine (models/generation) or the servings above it,
    and no import cycle (lazy and TYPE_CHECKING imports included) touches either package."""
    graph = _import_graph()
    decoder = {m for m in graph if m.startswith("models.decoder")}
    assert decoder, "models/decoder not found"
    upward = {(m, t) for m in decoder for t in graph[m]
              if t.startswith(("models.generation", "models.text_generation", "models.text_embedding", "server"))}
    assert not upward, upward
    touching = [c for c in _cycles(graph) if any(m.startswith(("models.decoder", "models.generation")) for m in c)]
    assert not touching, touching
