"""Packages import downward only: the allowed edges between the project's top-level packages, and no
import cycle between the modules of one package (``ACYCLIC``).

Read from the source with ``ast`` (every ``import``/``from`` at any depth, TYPE_CHECKING blocks
included), so an import hidden inside a function is caught too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "engine", "kvtransfer", "workers", "prefill_worker", "decode_worker", "gateway",
            "loadtest", "pdserve", "bench")
# package → the project packages it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "protocol": {"kvtransfer"},  # kvtransfer.compat and .curve only (NARROW below): pairing record, keys
    "engine": set(),
    "kvtransfer": set(),
    "workers": {"protocol", "engine", "kvtransfer"},
    "prefill_worker": {"protocol", "engine", "kvtransfer", "workers"},
    "decode_worker": {"protocol", "engine", "kvtransfer", "workers"},
    "gateway": {"protocol", "engine", "kvtransfer"},  # kvtransfer.compat, .curve only (NARROW below)
    "loadtest": {"protocol"},
    "pdserve": {"protocol", "engine", "kvtransfer", "workers", "prefill_worker", "decode_worker", "gateway",
                "loadtest"},
    "bench": {"protocol", "engine", "kvtransfer", "workers", "prefill_worker", "decode_worker", "gateway",
              "loadtest", "pdserve"},  # everything but tests/; nothing imports bench
}
# package → single modules of a package it may not import as a whole (the control-plane messages carry the
# engine's sampling params, a torch-free leaf: test_single_module_edges_are_leaves)
ALLOWED_MODULES: dict[str, set[str]] = {"protocol": {"engine.sampling_params"}}
HEAVY = {"torch", "transformers", "triton"}
ACYCLIC = ("gateway",)  # packages whose modules must not import each other in a cycle


# (package, package it may import) → the only modules of it allowed: torch-free ones
NARROW: dict[tuple[str, str], set[str]] = {
    ("protocol", "kvtransfer"): {"kvtransfer.compat", "kvtransfer.curve"},
    ("gateway", "kvtransfer"): {"kvtransfer.compat", "kvtransfer.curve"},
}


def imported_modules(package: str) -> dict[str, set[str]]:
    """Module path → the absolute module names it imports (relative imports resolved to the package)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                names.add(package if node.level else (node.module or ""))
        found[str(path.relative_to(ROOT))] = names
    return found


def project_imports(package: str) -> dict[str, set[str]]:
    """Module path → the other project packages it imports."""
    return {path: {n.split(".")[0] for n in names} & set(PACKAGES) - {package}
            for path, names in imported_modules(package).items()}


def forbidden_imports(package: str) -> dict[str, list[str]]:
    """Module path → the modules it imports from packages (or single modules) it may not import."""
    others = set(PACKAGES) - {package}
    wrong: dict[str, list[str]] = {}
    for path, names in imported_modules(package).items():
        bad = sorted(n for n in names if n.split(".")[0] in others and n.split(".")[0] not in ALLOWED[package]
                     and n not in ALLOWED_MODULES.get(package, set()))
        if bad:
            wrong[path] = bad
    return wrong


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_packages_below_it(package: str) -> None:
    wrong = forbidden_imports(package)
    allowed = sorted(ALLOWED[package] | ALLOWED_MODULES.get(package, set()))
    assert not wrong, f"{package} may import only {allowed}; found {wrong}"


def test_single_module_edges_are_leaves() -> None:
    """A module allowed on its own imports nothing of the project and nothing heavy, nor does its
    package's ``__init__`` (tests/gateway/test_no_torch.py imports protocol.messages with torch blocked)."""
    for module in set().union(*ALLOWED_MODULES.values()):
        package = module.split(".")[0]
        for rel in (f"{module.replace('.', '/')}.py", f"{package}/__init__.py"):
            names = imported_modules(package)[rel]
            wrong = {n.split(".")[0] for n in names} & (set(PACKAGES) | HEAVY)
            assert not wrong, f"{rel} imports {sorted(wrong)}"


def module_graph(package: str) -> dict[str, set[str]]:
    """Module name → the modules of the same package it imports (``from package import x`` counts x)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith(package + "."))
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mod = node.module or ""
                if mod == package:  # from package import module
                    deps.update(f"{mod}.{a.name}" for a in node.names)
                elif mod.startswith(package + "."):
                    deps.add(mod)
        graph[name] = deps - {name}
    return {m: {d for d in deps if d in graph} for m, deps in graph.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    trail: list[str] = []

    def visit(m: str) -> list[str] | None:
        if state.get(m) == 1:
            return [*trail[trail.index(m):], m]
        if state.get(m) == 2:
            return None
        state[m] = 1
        trail.append(m)
        for d in sorted(graph[m]):
            if (found := visit(d)) is not None:
                return found
        trail.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if (found := visit(m)) is not None:
            return found
    return None


@pytest.mark.parametrize("package", ACYCLIC)
def test_modules_of_a_package_import_no_cycle(package: str) -> None:
    cycle = find_cycle(module_graph(package))
    assert cycle is None, f"import cycle in {package}: {' -> '.join(cycle)}"


def test_cycle_finder_sees_a_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: two modules importing each other (one under TYPE_CHECKING) are reported."""
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "a.py").write_text("from gateway.b import f\n")
    (tmp_path / "gateway" / "b.py").write_text("if TYPE_CHECKING:\n    from gateway import a\n")
    (tmp_path / "gateway" / "c.py").write_text("import gateway.a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert find_cycle(module_graph("gateway")) == ["gateway.a", "gateway.b", "gateway.a"]


@pytest.mark.parametrize(("package", "target"), sorted(NARROW))
def test_narrow_edges_import_only_their_modules(package: str, target: str) -> None:
    allowed = NARROW[(package, target)]
    wrong = {path: sorted(n for n in names if n.split(".")[0] == target and n not in allowed)
             for path, names in imported_modules(package).items()}
    wrong = {path: names for path, names in wrong.items() if names}
    assert not wrong, f"{package} may import only {sorted(allowed)} of {target}; found {wrong}"


def test_what_protocol_and_the_gateway_take_from_kvtransfer_pulls_in_no_torch() -> None:
    """kvtransfer.compat (and the kvtransfer package it runs first) import no torch: protocol.messages
    and gateway.registry load in a fresh interpreter without torch in sys.modules."""
    import subprocess

    code = ("import sys; import protocol.messages, gateway.registry, kvtransfer.compat; "
            "heavy = sorted(m for m in sys.modules "
            "               if m.split('.')[0] in ('torch', 'transformers', 'triton')); "
            "print(heavy); sys.exit(1 if heavy else 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]


def test_allowed_edges_have_no_cycle() -> None:
    state: dict[str, int] = {}

    def visit(p: str, trail: list[str]) -> None:
        assert state.get(p) != 1, f"import cycle: {' -> '.join([*trail, p])}"
        if state.get(p) == 2:
            return
        state[p] = 1
        for q in sorted(ALLOWED[p] | {m.split(".")[0] for m in ALLOWED_MODULES.get(p, set())}):
            visit(q, [*trail, p])
        state[p] = 2

    for p in PACKAGES:
        visit(p, [])


def test_gateway_imports_no_torch_anywhere() -> None:
    """Static half of the rule (tests/gateway/test_no_torch.py imports the app with torch blocked)."""
    tops = {path: {n.split(".")[0] for n in names} for path, names in imported_modules("gateway").items()}
    wrong = {path: sorted(t & HEAVY) for path, t in tops.items() if t & HEAVY}
    assert not wrong, f"the gateway imports {wrong}"


def test_checker_sees_a_forbidden_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: an engine module importing the gateway (inside a function) is reported."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "bad.py").write_text("def f():\n    from gateway.app import create_app\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert project_imports("engine") == {"engine/bad.py": {"gateway"}}
