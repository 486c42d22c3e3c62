"""The product card's layout rules: packages, one-way dependencies, a light serving path."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "forecasting", "prefill", "store")
# What each package may import from the others (dependencies point one way).
ALLOWED = {"store": set(), "forecasting": {"store"}, "prefill": {"store", "forecasting"}, "flows": set(PACKAGES)}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_dependencies_point_one_way(package: str) -> None:
    for path in (REPO / package).rglob("*.py"):
        used = _imports(path) & set(PACKAGES) - {package}
        assert used <= ALLOWED[package], f"{path.relative_to(REPO)} imports {sorted(used - ALLOWED[package])}"


def _full_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}  # from forecasting import simulate
    return out


def test_policy_code_never_imports_the_simulator() -> None:
    # The oracle prewarm and Belady read the future: they are ceilings in forecasting.simulate,
    # and the planner (what ships) must not be able to reach them.
    for path in (REPO / "forecasting" / "planning").rglob("*.py"):
        used = {m for m in _full_imports(path) if m == "forecasting.simulate" or m.startswith("forecasting.simulate.")}
        assert not used, f"{path.relative_to(REPO)} imports {sorted(used)}: policy code never imports the simulator"


@pytest.mark.parametrize("package", PACKAGES)
def test_product_code_never_imports_bench_or_tests(package: str) -> None:
    for path in (REPO / package).rglob("*.py"):
        used = _imports(path) & {"bench", "tests"}
        assert not used, f"{path.relative_to(REPO)} imports {sorted(used)}: research and test code stay out of the product"


def test_serving_path_imports_only_store_and_its_light_deps() -> None:
    code = (
        "import sys; import store.tiers.store, store.format.snapshot, store.identity.keys, store.tiers.local;"
        "heavy = [m for m in ('prefect', 'statsmodels', 'transformers', 'datasketch', 'flows', 'prefill', 'forecasting', 's3fs')"
        " if m in sys.modules]; print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"serving path pulled in: {out.stdout.strip()}"


def _test_modules_imported(path: Path, text: str | None = None) -> set[str]:
    """The modules ``path`` (or ``text`` as if it were ``path``) imports that are test modules or a conftest."""
    package = path.relative_to(REPO).parent.parts
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8") if text is None else text)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = list(package[: len(package) - node.level + 1]) if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            names |= {base} | {f"{base}.{a.name}" for a in node.names if _is_test_module(a.name)}  # maybe a module
    return {n for n in names if any(_is_test_module(p) for p in n.split("."))}


def _is_test_module(name: str) -> bool:
    return name.startswith("test_") or name == "conftest"


def test_no_test_module_imports_another() -> None:
    """Shared helpers live in helper modules (tests/store/factories.py...) and fixtures in conftest.py, which
    pytest finds itself: a test module imported by another couples the two and runs its code twice."""
    found = {str(p.relative_to(REPO)): sorted(used) for p in sorted((REPO / "tests").rglob("*.py"))
             if (used := _test_modules_imported(p))}
    assert found == {}, f"these import test modules or conftests: {found}"


@pytest.mark.parametrize("code, imports_a_test_module", [
    ("from tests.store.tiers.test_store import ACME", True),
    ("from tests.flows.conftest import x", True),
    ("import test_thing", True),
    ("from .test_pool import y", True),
    ("from . import conftest", True),
    ("from ..tiers import test_store", True),
    ("from tests.store import factories", False),
    ("from tests.store.factories import ACME", False),
    ("from .factories import ACME", False),
    ("import testing", False),
])
def test_the_import_check_sees_test_modules_and_conftests(code: str, imports_a_test_module: bool) -> None:
    as_if = REPO / "tests" / "store" / "serving" / "helper.py"  # only its place in the tree is used
    assert bool(_test_modules_imported(as_if, code)) is imports_a_test_module


def test_console_script_is_declared() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert 'name = "kvwarm"' in text and 'prefill = "prefill.cli:main"' in text


def test_the_vllm_connector_imports_light() -> None:
    """``store.engines.vllm`` (imported by vLLM in each of its processes) pulls in neither Prefect nor
    statsmodels, and its pure parts need neither vLLM nor transformers (they are tested without them)."""
    pure = ", ".join(f"store.engines.vllm.{m}" for m in (
        "settings", "tenancy", "layout", "paging", "planning", "costs", "probe", "fetches", "tracker", "metadata",
        "stats", "scheduler", "worker", "writeback"))
    code = (
        f"import sys, store.engines.vllm, {pure};"
        "heavy = [m for m in ('prefect', 'statsmodels', 'datasketch', 'transformers', 'vllm', 'flows', 'prefill',"
        " 'forecasting') if m in sys.modules]; print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the connector's pure modules pulled in: {out.stdout.strip()}"
    for path in (REPO / "store" / "engines" / "vllm").glob("*.py"):
        used = _imports(path)
        assert not used & {"prefect", "statsmodels", "datasketch"}, f"{path.name} imports {used}"
        if path.stem not in ("connector", "prom", "cpu_backend"):
            assert "vllm" not in used, f"{path.name} imports vllm: only connector.py, prom.py and cpu_backend.py may"


@pytest.mark.parametrize("folder", PACKAGES + ("bench", "tests"))
def test_every_module_is_small(folder: str) -> None:
    """The research and test code too: a 475-line bench or a 411-line test module holds two concepts."""
    for path in (REPO / folder).rglob("*.py"):
        lines = path.read_text(encoding="utf-8").count("\n")
        assert lines <= 400, (f"{path.relative_to(REPO)} has {lines} lines: split it along a seam (one concept "
                              f"per module, under 400)")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_says_what_it_is(package: str) -> None:
    for path in (REPO / package).rglob("*.py"):
        where = path.relative_to(REPO)
        assert ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))), \
            f"{where} does not open with a docstring saying what it is"
