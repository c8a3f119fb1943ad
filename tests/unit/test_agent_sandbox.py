"""The Python tool's sandbox limits, each shown by code that would get past it without the limit: a busy
loop (CPU time), a 1 GiB allocation (memory), a connection to a socket this test listens on (network:
through the network namespace, and through the audit hook that replaces it where ``unshare`` is
refused), and the working directory (fresh, empty, deleted afterwards)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from megatron_rlhf.agent import builtin_tools
from megatron_rlhf.agent.builtin_tools import PythonTool

SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}


def run(code: str, **config: float) -> str:
    response, _, _ = PythonTool(config, SCHEMA).execute("id", {"code": code})
    return response.text


def test_output_and_errors_come_back() -> None:
    assert run("print(6 * 7)") == "42"
    text = run("print('before')\n1 / 0")
    assert text.startswith("before\nTraceback (most recent call last):\n") and "ZeroDivisionError" in text
    assert text.endswith("exit code 1") and "runpy" not in text  # the traceback starts at the user's code


def test_a_busy_loop_is_killed_at_its_cpu_time() -> None:
    assert run("while True:\n    pass", cpu_time_s=1, wall_time_s=30) == "killed: the CPU-time limit (1 s) was reached"


def test_a_sleeping_call_is_killed_at_its_wall_time() -> None:
    assert run("import time\ntime.sleep(60)", wall_time_s=1) == "killed: the wall-time limit (1 s) was reached"


def test_an_allocation_past_the_memory_limit_fails() -> None:
    text = run("block = bytearray(1 << 30)\nprint('allocated')", memory_mb=256)
    assert "allocated" not in text and "MemoryError" in text, text


@pytest.mark.parametrize("namespace", [True, False], ids=["network-namespace", "audit-hook"])
def test_the_code_cannot_connect(namespace: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if namespace and not builtin_tools.network_namespace_prefix():
        pytest.skip("unshare --net is not allowed here")
    if not namespace:
        monkeypatch.setattr(builtin_tools, "network_namespace_prefix", lambda: ())
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        text = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)\nprint('connected')")
    assert "connected" not in text and "exit code 1" in text, text
    if not namespace:
        assert "PermissionError: sandbox: socket." in text, text


def test_each_call_runs_in_a_fresh_empty_directory_deleted_after() -> None:
    code = "import os\nprint(os.getcwd())\nprint(os.listdir('.'))\nopen('left.txt', 'w').write('x')"
    first, second = run(code).splitlines(), run(code).splitlines()
    assert first[1] == second[1] == "[]" and first[0] != second[0]
    assert not Path(first[0]).exists() and Path(first[0]).name == "work"


def test_output_is_capped() -> None:
    assert run("print('x' * 5000)", max_output_chars=100) == "x" * 100 + "...(output truncated)"


def test_bad_settings_are_named() -> None:
    says = r"PythonTool config: unknown keys \['cpu_s'\], not positive numbers \['memory_mb'\]"
    with pytest.raises(ValueError, match=says):
        PythonTool({"cpu_s": 1, "memory_mb": 0}, SCHEMA)
    with pytest.raises(ValueError, match=r"PythonTool config: not positive numbers \['memory_mb'\]; the keys"):
        PythonTool({"memory_mb": 0}, SCHEMA)  # before: "unknown keys [], not positive numbers ..."


def test_the_runs_environment_variables_stay_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert run("import os\nprint(os.environ.get('HF_TOKEN'), os.environ['HOME'] == os.getcwd())") == "None True"
