"""Recipes (``lightning-nvme train recipe=NAME``), shipped in the wheel as ``lightning_nvme.recipes``."""
