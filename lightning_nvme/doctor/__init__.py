"""``lightning-nvme doctor``: one feature, the disk check. ``command`` (the command: the checks, findings and
advice), ``disk`` (one disk's bandwidth, its chunk size and workers tuned), ``striped`` (several disks measured
alone and striped together), ``profile`` (the tuned ``IOProfile`` the command writes and the strategies read
with ``io_profile=FILE``, and what the slowest of several disks costs).

Why below the strategies: they load the profile; the command itself imports nothing above the checks it runs.
"""
