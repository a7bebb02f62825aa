"""Hydra config groups of ``lightning-nvme train``, shipped in the wheel as ``lightning_nvme.conf``."""
