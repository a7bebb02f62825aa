"""Lightning callbacks of lightning_nvme."""

from lightning_nvme.callbacks.activation_offload import NVMeActivationOffload

__all__ = ["NVMeActivationOffload"]
