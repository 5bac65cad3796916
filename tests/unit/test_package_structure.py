"""The package's dependency direction: `lightning_moe.nn` knows nothing of `precision`, the
strategies or Lightning; no two modules import each other, directly or through others (imports
inside functions included: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import lightning_moe

PACKAGE = Path(lightning_moe.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body at run time (packages'
    ``__init__`` excluded as targets: they only re-export)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for candidate in candidates:
                if candidate in modules and candidate != name and modules[candidate].name != "__init__.py":
                    targets.add(candidate)
        graph[name] = targets
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, or [] where there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_no_import_cycles():
    assert _cycle(_imports()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_nn_imports_neither_precision_nor_lightning_nor_the_strategies():
    for name, targets in _imports().items():
        if name.startswith("lightning_moe.nn"):
            above = sorted(t for t in targets if not t.startswith(("lightning_moe.nn", "lightning_moe.kernels")))
            assert above == [], f"{name} imports {above}"


def test_importing_nn_loads_no_lightning():
    code = ("import sys, lightning_moe.nn\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'lightning' or m.startswith("
            "('lightning_moe.precision', 'lightning_moe.strategies', 'lightning_moe.callbacks')))\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_strategy_name_registers_with_the_strategies():
    code = ("import lightning_moe\n"
            "from lightning.pytorch.strategies import StrategyRegistry\n"
            "assert 'megatron_moe' not in StrategyRegistry  # Lightning came after: nothing registered yet\n"
            "from lightning_moe import MegatronMoEStrategy\n"
            "assert 'megatron_moe' in StrategyRegistry\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    code = "import lightning.pytorch, lightning_moe\nfrom lightning.pytorch.strategies import StrategyRegistry\n" \
           "assert 'megatron_moe' in StrategyRegistry\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
