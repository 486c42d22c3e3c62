"""Every error the product defines is a KvwarmError of exactly one kind (bad input or operational)."""
from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

from store.errors import BadInputError, KvwarmError, OperationalError

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "forecasting", "prefill", "store")
# engines a serving node brings itself; the modules that import them are checked where they are installed
OPTIONAL_ENGINES = {"vllm"}


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        names.append(package)
        for info in pkgutil.walk_packages([str(REPO / package)], prefix=f"{package}."):
            names.append(info.name)
    return names


def _project_exceptions() -> list[type[BaseException]]:
    found = []
    for name in _modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] in OPTIONAL_ENGINES:
                continue
            raise
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == name:
                found.append(obj)
    return found


def test_every_project_error_is_a_kvwarm_error_of_one_kind() -> None:
    errors = _project_exceptions()
    assert {"ConfigError", "PlanError", "DeadlinePassed", "TraceError", "StoreUnreachable"} <= {e.__name__ for e in errors}
    for exc in errors:
        where = f"{exc.__module__}.{exc.__name__}"
        assert issubclass(exc, KvwarmError), f"{where} does not derive from store.errors.KvwarmError"
        assert not (issubclass(exc, BadInputError) and issubclass(exc, OperationalError)), f"{where} is of both kinds"
        if not issubclass(exc, (BadInputError, OperationalError)):
            # a family base: only its members (each of one kind) are raised
            assert exc.__subclasses__(), f"{where} is neither BadInputError nor OperationalError"


def test_no_code_raises_a_family_base_itself() -> None:
    bases = {e.__name__ for e in _project_exceptions() if not issubclass(e, (BadInputError, OperationalError))}
    assert {"KvwarmError", "StoreError", "PrefillError"} <= bases
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                    func = node.exc.func
                    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                    assert name not in bases, (f"{path.relative_to(REPO)}:{node.lineno} raises the family base {name}; "
                                               f"raise a member of one kind (bad input or operational)")
