import sys

from megatron_rlhf.cli import main

if __name__ == "__main__":  # the guard matters: the checkpoint writer spawns processes
    sys.exit(main())
