"""Activation offload to the flat store, independent of Lightning (the callback is a thin wrapper)."""

from lightning_nvme.activations.arena import ActivationArena
from lightning_nvme.activations.meter import ResidencyMeter, SavedActivationMeter
from lightning_nvme.activations.offloader import ActivationOffloader, OffloadStats

__all__ = ["ActivationArena", "ActivationOffloader", "OffloadStats", "ResidencyMeter", "SavedActivationMeter"]
