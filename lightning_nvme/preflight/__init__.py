"""Checks before training, so a run fails in its first second with the fix rather than hours in:
``resources`` (directories, free space, host and device memory budgets, disks shared by stripes) and
``checkpoint_space`` (the checkpoints a run will keep, from its Trainer and callbacks, against the free space).
"""
