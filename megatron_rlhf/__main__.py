from megatron_rlhf.cli import entry

if __name__ == "__main__":  # the guard matters: the checkpoint writer spawns processes
    entry()
