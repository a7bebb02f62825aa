"""Lightning callbacks of lightning_nvme."""

from lightning_nvme.callbacks.activation_offload import NVMeActivationOffload
from lightning_nvme.callbacks.io_telemetry import IOTelemetry

__all__ = ["IOTelemetry", "NVMeActivationOffload"]
