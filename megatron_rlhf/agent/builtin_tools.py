"""Built-in tools, named in a tools file by class path (``megatron_rlhf.agent.builtin_tools.Calculator``,
``megatron_rlhf.agent.builtin_tools.PythonTool``); each declares its arguments in the file's
``tool_schema`` (``expression``, ``code``: strings)."""

from __future__ import annotations

import ast
import functools
import math
import operator
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from megatron_rlhf.agent.tools import BaseTool, ToolResponse

__all__ = ["Calculator", "CalculatorError", "PythonTool", "evaluate"]


class CalculatorError(ValueError):
    """An expression the calculator refuses: not arithmetic, or past its limits."""


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_BITS = 4096
"""Integers beyond this many bits are refused: ``9**9**9`` would otherwise take the host's memory."""


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
        raise CalculatorError(f"the result has more than {MAX_RESULT_BITS} bits")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    exact = isinstance(base, int) and isinstance(exponent, int) and exponent > 0
    if exact and max(int(base).bit_length() - 1, 0) * exponent > MAX_RESULT_BITS:
        raise CalculatorError(f"the power has more than {MAX_RESULT_BITS} bits")
    result = base**exponent
    if isinstance(result, complex):
        raise CalculatorError("a negative number to a fractional power is not a real number")
    return result


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError as exc:
            raise CalculatorError("division by zero") from exc
    raise CalculatorError(f"not arithmetic: {ast.unparse(node)!r} (numbers, + - * / // % **, parentheses)")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression, computed by walking its syntax tree (nothing is ``eval``'d)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an expression: {exc.msg}") from exc
    try:
        return _value(tree.body)
    except OverflowError as exc:
        raise CalculatorError(f"overflow: {exc}") from exc


class Calculator(BaseTool):
    """Arithmetic on integers and floats: ``expression`` -> its value, or the reason it has none."""

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        try:
            return ToolResponse(str(evaluate(str(parameters["expression"])))), 0.0, {}
        except CalculatorError as exc:
            return ToolResponse(f"Error: {exc}"), 0.0, {}


# Runs first in the child: the limits (hard limits too, which an unprivileged process cannot raise
# again; SIGXCPU at the CPU soft limit, SIGKILL a second later if the code catches it), then, without a
# network namespace, an audit hook (which code cannot remove) refusing sockets and new processes (a
# child process would run without the hook); then the user's code as __main__, whose traceback starts
# at its own frames.
_BOOTSTRAP = """
import resource, runpy, sys, traceback
path, cpu_s, memory_bytes, file_bytes, hook = sys.argv[1], *map(int, sys.argv[2:6])
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
if hook:
    blocked = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "ctypes.")
    def refuse(event, args):
        if event.startswith(blocked) and event != "socket.gethostname":
            raise PermissionError(f"sandbox: {event} is not allowed (no network, no processes)")
    sys.addaudithook(refuse)
sys.argv = [path]
try:
    runpy.run_path(path, run_name="__main__")
except SystemExit:
    raise
except BaseException as exc:
    frames = exc.__traceback__
    while frames is not None and frames.tb_frame.f_code.co_filename != path:
        frames = frames.tb_next
    traceback.print_exception(type(exc), exc, frames)
    sys.exit(1)
"""


@functools.cache
def network_namespace_prefix() -> tuple[str, ...]:
    """The ``unshare`` command that runs a process in a new, empty network namespace here; empty where
    the kernel or the container does not allow one (the sandbox then falls back to the audit hook)."""
    unshare = shutil.which("unshare")
    for prefix in (("--net",), ("--user", "--map-root-user", "--net")):
        if unshare is None:
            break
        command = (unshare, *prefix)
        try:
            if subprocess.run([*command, "true"], capture_output=True, timeout=10).returncode == 0:
                return command
        except (OSError, subprocess.SubprocessError):
            continue
    return ()


class PythonTool(BaseTool):
    """Runs ``code`` in a fresh Python subprocess and answers with its stdout and stderr.

    Guarantees, per call: a CPU-time limit (``cpu_time_s``, RLIMIT_CPU: the process is killed past
    it) and a wall-time limit (``wall_time_s``: its process group is killed); an address-space limit
    (``memory_mb``, RLIMIT_AS: allocations past it fail); a new empty temporary working directory,
    deleted afterwards; an environment of its own (none of the run's variables: its tokens and keys
    stay out of what the model can print); no network: a new network namespace (only a down
    loopback) where ``unshare`` works, else an audit hook in the interpreter that refuses sockets,
    new processes and ctypes; output read only up to ``max_output_chars`` (files it writes are
    capped at 16 MiB each).

    Not guaranteed: isolation of the file system (the code runs as this user and can read and write
    what it can), of other processes' resources, or against a determined attacker on the audit-hook
    fallback (a C extension can bypass it). Use a container for untrusted code beyond RL rollouts.
    """

    SETTINGS: Mapping[str, float] = {"cpu_time_s": 5, "wall_time_s": 10, "memory_mb": 512, "max_output_chars": 4096}
    """The tool's ``config`` keys in the tools file, and their defaults."""
    FILE_BYTES = 16 << 20

    def __init__(self, config: Mapping[str, Any], tool_schema: Mapping[str, Any]) -> None:
        super().__init__(config, tool_schema)
        unknown = sorted(set(self.config) - set(self.SETTINGS))
        bad = [
            key
            for key, value in self.config.items()
            if key in self.SETTINGS and not (isinstance(value, (int, float)) and value > 0)
        ]
        if unknown or bad:
            problems = ([f"unknown keys {unknown}"] if unknown else []) + (
                [f"not positive numbers {bad}"] if bad else []
            )
            raise ValueError(
                f"PythonTool config: {', '.join(problems)}; the keys and their defaults are {dict(self.SETTINGS)}"
            )
        self.limits = {**self.SETTINGS, **self.config}

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        root = Path(tempfile.mkdtemp(prefix="python-tool-"))
        try:
            return ToolResponse(self._run(str(parameters["code"]), root)), 0.0, {}
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _run(self, code: str, root: Path) -> str:
        work, main = root / "work", root / "main.py"
        work.mkdir()
        main.write_text(code, encoding="utf-8")
        namespace = network_namespace_prefix()
        limits = [
            math.ceil(self.limits["cpu_time_s"]),  # RLIMIT_CPU counts whole seconds
            int(self.limits["memory_mb"]) << 20,
            self.FILE_BYTES,
            int(not namespace),
        ]
        command = [*namespace, sys.executable, "-I", "-c", _BOOTSTRAP, str(main), *map(str, limits)]
        with open(root / "stdout", "w+b") as stdout, open(root / "stderr", "w+b") as stderr:
            process = subprocess.Popen(
                command,
                cwd=work,
                env={"PATH": os.defpath, "HOME": str(work), "LANG": "C.UTF-8"},
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
            try:
                returncode = process.wait(timeout=self.limits["wall_time_s"])
                status = "" if returncode == 0 else self._status(returncode)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                status = f"killed: the wall-time limit ({self.limits['wall_time_s']} s) was reached"
            cap = int(self.limits["max_output_chars"])
            out, err = (self._head(stream, cap) for stream in (stdout, stderr))
        return "\n".join(part.rstrip("\n") for part in (out, err, status) if part)

    def _status(self, returncode: int) -> str:
        if returncode == -signal.SIGXCPU:
            return f"killed: the CPU-time limit ({self.limits['cpu_time_s']} s) was reached"
        if returncode < 0:
            return f"killed by signal {signal.Signals(-returncode).name}"
        return f"exit code {returncode}"

    @staticmethod
    def _head(stream: Any, cap: int) -> str:
        stream.seek(0)
        text = stream.read(4 * cap).decode("utf-8", errors="replace")
        return text[:cap] + ("...(output truncated)" if len(text) > cap else "")
