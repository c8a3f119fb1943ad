"""What the console shows (``metrics/log.py``): known-harmless notices silenced by module and message
while a new notice still shows on rank 0; ranks other than 0 print errors only; a progress bar on a
terminal (a pseudo-terminal here) and plain lines elsewhere; the interpreter in the start-up report."""

from __future__ import annotations

import fcntl
import os
import platform
import struct
import subprocess
import sys
import termios
import textwrap

import pytest

from tests.launch import subprocess_env

NOTICES = textwrap.dedent(
    """
    import logging, warnings
    from megatron_rlhf.metrics.log import quiet_console

    quiet_console()
    # Attributed to the module megatron's optimizer warns from, as Python does for the real one.
    def warn(message, module):
        warnings.warn_explicit(message, UserWarning, module.replace(".", "/") + ".py", 68, module=module)

    grad = "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed."
    warn(grad, "megatron.core.optimizer.optimizer")
    warn(grad, "my_project.train")
    warn("a new notice", "megatron.core.optimizer.optimizer")
    saver = logging.getLogger("megatron.core.dist_checkpointing.strategies.torch")
    saver.warning("MCore's async save is deprecated and will be removed in the future releases.")
    saver.warning("another saver notice")
    saver.error("a saver error")
    logging.getLogger("torch.distributed").warning("a torch notice")
    """
)


def _notices_printed(rank: str) -> str:
    env = subprocess_env(RANK=rank)
    proc = subprocess.run([sys.executable, "-c", NOTICES], env=env, capture_output=True, text=True, check=True)
    return proc.stdout + proc.stderr


def test_rank_0_shows_new_notices_and_errors_but_not_the_known_harmless_ones() -> None:
    printed = _notices_printed("0")
    assert printed.count("not a leaf Tensor") == 1 and "my_project/train.py" in printed  # same text, other module
    assert "a new notice" in printed and "another saver notice" in printed and "a torch notice" in printed
    assert "a saver error" in printed
    assert "async save is deprecated" not in printed


def test_other_ranks_print_errors_only() -> None:
    printed = _notices_printed("1")
    assert printed.strip().splitlines() == [printed.strip()] and printed.strip().endswith("a saver error")


PROGRESS = textwrap.dedent(
    """
    from megatron_rlhf.metrics.log import Progress
    from megatron_rlhf.metrics.sinks import ConsoleSink

    sink = ConsoleSink(lambda values: f"reward {values['reward']:.4f}", total_steps=3, log_every=10, resumed_step=None)
    for step in (1, 2, 3):
        sink.write("train", step, {"reward": step / 4})
    sink.close()
    progress = Progress("generate", 8, "completions")
    for done in (4, 8):
        progress(done)
    """
)


def _progress_output(terminal: bool) -> str:
    """The console of ``PROGRESS`` with stdout a pseudo-terminal or a pipe."""
    if not terminal:
        return subprocess.run(
            [sys.executable, "-c", PROGRESS], env=subprocess_env(), capture_output=True, text=True, check=True
        ).stdout
    controller, terminal_fd = os.openpty()
    fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns of a window
    proc = subprocess.Popen([sys.executable, "-c", PROGRESS], env=subprocess_env(), stdout=terminal_fd)
    os.close(terminal_fd)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the process closed its end: Linux reports EIO
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert proc.wait() == 0
    return b"".join(chunks).decode()


def test_a_terminal_gets_bars_with_the_progress_figures() -> None:
    shown = _progress_output(terminal=True)
    assert "steps: 100%" in shown and "3/3" in shown and "reward 0.7500" in shown  # the last step's figures
    assert "generate: 100%" in shown and "8/8" in shown
    # The step lines (first and last) stay above the bar, the ETA included.
    assert "step 1/3 | reward 0.2500 | eta" in shown and "step 3/3 | reward 0.7500 | eta 0:00:00" in shown


def test_a_log_gets_plain_lines() -> None:
    lines = _progress_output(terminal=False).splitlines()
    assert [line.split(" | eta")[0] for line in lines[:2]] == ["step 1/3 | reward 0.2500", "step 3/3 | reward 0.7500"]
    assert lines[2:] == [lines[2]] and lines[2].startswith("generate: 8/8 completions (")
    assert "%" not in "".join(lines)


def test_the_start_up_report_names_the_interpreter_and_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_rlhf.metrics.log import environment_report

    report = environment_report()
    assert f"python {platform.python_version()} {sys.executable}, " in report
    if sys.prefix != sys.base_prefix:
        assert f", venv {sys.prefix};" in report
