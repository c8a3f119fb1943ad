"""setup.py's promises: every runtime dependency is used by the package, and the torch lower bound is
the torch that CI runs (so the bound has been tested, not guessed)."""

from __future__ import annotations

import ast
import importlib.metadata
import re

import torch
from packaging.requirements import Requirement
from packaging.version import Version

from tests.helpers import REPO

IMPORT_NAMES = {
    "megatron-core": ("megatron",),
    "tensorboard": ("torch.utils.tensorboard",),  # torch's SummaryWriter imports tensorboard
    "jinja2": ("jinja2",),
    "pyarrow": ("pyarrow",),
}
"""How the package imports a distribution whose import name is not its own name."""


def _setup_keyword(name: str) -> ast.expr:
    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    return next(k.value for k in call.keywords if k.arg == name)


def runtime_requirements() -> list[Requirement]:
    listed = _setup_keyword("install_requires")
    assert isinstance(listed, ast.List), "setup.py's install_requires is a list literal"
    return [Requirement(ast.literal_eval(item)) for item in listed.elts]


def package_sources() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "megatron_rlhf").rglob("*.py"))


def test_every_runtime_dependency_is_imported_by_the_package() -> None:
    sources = package_sources()
    unused = []
    for req in runtime_requirements():
        modules = IMPORT_NAMES.get(req.name, (req.name.replace("-", "_"),))
        pattern = "|".join(rf"(^|\n)\s*(import|from) {re.escape(m)}\b" for m in modules)
        if not re.search(pattern, sources):
            unused.append(req.name)
    assert not unused, f"declared in setup.py's install_requires but never imported by megatron_rlhf: {unused}"


def test_torch_lower_bound_is_the_torch_ci_runs() -> None:
    torch_req = next(r for r in runtime_requirements() if r.name == "torch")
    lower = [Version(s.version) for s in torch_req.specifier if s.operator == ">="]
    assert len(lower) == 1, f"setup.py's torch requirement {torch_req} needs one >= bound"
    pins = (REPO / "constraints-ci.txt").read_text(encoding="utf-8")
    pinned = re.search(r"^torch==(\S+)", pins, re.M)
    assert pinned, "constraints-ci.txt pins torch"
    ci_torch = Version(pinned.group(1))
    assert (ci_torch.major, ci_torch.minor) == (lower[0].major, lower[0].minor), (
        f"CI runs torch {ci_torch} (constraints-ci.txt) but setup.py claims {torch_req}: "
        "a lower bound CI never runs is untested"
    )
    assert Version(torch.__version__.split("+")[0]) >= lower[0]


def test_installed_metadata_matches_setup_py() -> None:
    """The editable install was made from this setup.py (scripts/setup_env.sh reinstalls on a change)."""
    installed = {Requirement(r).name for r in importlib.metadata.requires("megatron-rlhf") or [] if "extra" not in r}
    assert installed == {r.name for r in runtime_requirements()}
