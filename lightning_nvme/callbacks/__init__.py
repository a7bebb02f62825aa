"""Lightning callbacks of lightning_nvme."""

from lightning_nvme.callbacks.io_telemetry import IOTelemetry

__all__ = ["IOTelemetry"]
