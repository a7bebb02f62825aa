"""File-system helpers every layer above uses: atomic file replacement (``atomic``), what a file system is and
where its disk sits (``fsinfo``), and whether and how it clones file ranges (``reflink``).

Why one package: these are the only modules that talk to the file system itself rather than to the store; they
import nothing of ``lightning_nvme`` but its units, so any layer may use them.
"""
