#!/usr/bin/env bash
# Sets up .venv if needed, then runs the test suite: unit and torchrun/gloo tiers everywhere, plus
# the `gpu` tier when a CUDA device is visible. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
bash scripts/setup_env.sh test || exit 1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  marker="gpu or not gpu"
  parallel=()  # GPU tests share the device: one at a time
else
  marker="not gpu"
  # Two pytest workers (TEST_WORKERS), each taking whole test files in collection order (conftest.py
  # puts the longest first): single-process tests leave a core idle otherwise. -n 0 turns it off.
  parallel=(-n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
fi
.venv/bin/python -m pytest -m "$marker" "${parallel[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then  # pytest: no test collected (e.g. a -k filter matched nothing)
  echo "test.sh: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
