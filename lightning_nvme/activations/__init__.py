"""Activation offload to the flat store, independent of Lightning (the callback is a thin wrapper)."""

from lightning_nvme.activations.arena import ActivationArena
from lightning_nvme.activations.meter import ResidencyMeter, SavedActivationMeter
from lightning_nvme.activations.offloader import ActivationOffloader
from lightning_nvme.activations.records import OffloadStats
from lightning_nvme.activations.settings import ActivationSettings

__all__ = ["ActivationArena", "ActivationOffloader", "ActivationSettings", "OffloadStats", "ResidencyMeter", "SavedActivationMeter"]
