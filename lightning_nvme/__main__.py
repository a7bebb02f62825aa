"""``python -m lightning_nvme``: the same command line as ``lightning-nvme``."""

from lightning_nvme.cli import main

raise SystemExit(main())
