"""The package's import drawing: folders form layers, and imports only go down or sideways.

Read from the source with ``ast`` (every ``import``, at any depth, TYPE_CHECKING included), so a
new upward import fails here with the file that makes it.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rlhf"

# Lowest first; docs/architecture.md draws the same layers.
LAYERS = [
    {"fusion", "parallel", "config", "metrics", "algorithms", "tasks", "debug"},
    {"models"},
    {"data", "training"},
    {"checkpoint"},
    {"rollout", "rewards", "agent"},
    {"hybrid"},
    {"trainer"},
    {"commands", "cli", "__main__", "docs"},
]
LAYER_OF = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}


def _room(module: str) -> str:
    """megatron_rlhf.rollout.native -> rollout; megatron_rlhf.cli -> cli."""
    return module.split(".")[1]


def import_edges(package: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """(from room, to room) -> the files that make that import."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        if module.endswith(".__init__"):
            module = module.removesuffix(".__init__") + ".__init__"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from .x import y inside megatron_rlhf/<room>/
                    parts = module.split(".")[: -node.level]
                    targets = [".".join(parts + ([node.module] if node.module else []))]
                else:
                    targets = [node.module or ""]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("megatron_rlhf.") and module.count(".") >= 1:
                    src, dst = _room(module), _room(target)
                    if src != dst:
                        edges.setdefault((src, dst), []).append(str(path.relative_to(package.parent)))
    return edges


def test_every_room_has_a_layer():
    rooms = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")
    }
    assert rooms == set(LAYER_OF), f"rooms without a layer: {rooms - set(LAYER_OF)}; stale: {set(LAYER_OF) - rooms}"


def test_imports_never_go_up():
    upward = {edge: files for edge, files in import_edges().items() if LAYER_OF[edge[0]] < LAYER_OF[edge[1]]}
    assert not upward, "imports from a lower layer to a higher one: " + "; ".join(
        f"{src} -> {dst} in {sorted(set(files))}" for (src, dst), files in upward.items()
    )


def test_no_loop_between_rooms():
    graph: dict[str, set[str]] = {}
    for src, dst in import_edges():
        graph.setdefault(src, set()).add(dst)

    def reaches(start: str, goal: str) -> bool:
        seen, stack = set(), [start]
        while stack:
            room = stack.pop()
            if room == goal:
                return True
            if room not in seen:
                seen.add(room)
                stack.extend(graph.get(room, ()))
        return False

    loops = [(a, b) for a, b in itertools.permutations(graph, 2) if b in graph[a] and reaches(b, a)]
    assert not loops, f"import loops between rooms: {loops}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule can fail: a bottom-layer file importing the trainer (relative or absolute) is found."""
    fake = tmp_path / "megatron_rlhf"
    for room in ("parallel", "trainer"):
        (fake / room).mkdir(parents=True)
        (fake / room / "__init__.py").write_text("")
    (fake / "parallel" / "bad.py").write_text("from megatron_rlhf.trainer import loop\nfrom ..trainer import x\n")
    assert import_edges(fake) == {("parallel", "trainer"): ["megatron_rlhf/parallel/bad.py"] * 2}
