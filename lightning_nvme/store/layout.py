"""The offset table of a flat store: named regions at 4 KiB-aligned offsets in one file.

Why one table instead of one file per tensor: small files and small requests are what make SSD
offload slow (metadata, open/close per request). A region is a (offset, nbytes) slice of the one
preallocated file; the table is saved as JSON and hashed so a reopened store can be checked.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from lightning_nvme.constants import ALIGN, align_up

HEADER_BYTES = ALIGN  # the first block of the file holds the header
STORE_FORMAT_VERSION = 1  # of the store file (header + manifest); the checkpoint formats have their own


@dataclass(frozen=True)
class Region:
    """One named slice of the store file. ``capacity`` is ``nbytes`` rounded up to ``ALIGN``."""

    name: str
    offset: int
    nbytes: int
    capacity: int
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.offset + self.capacity


@dataclass
class Layout:
    """The regions of one store, in file order. Regions are only ever appended."""

    regions: dict[str, Region] = field(default_factory=dict)
    end: int = HEADER_BYTES

    def add(self, name: str, nbytes: int, dtype: str = "uint8", shape: tuple[int, ...] = ()) -> Region:
        if name in self.regions:
            raise ValueError(f"region {name!r} already exists in the store layout")
        if nbytes < 0:
            raise ValueError(f"region {name!r}: nbytes must be >= 0, got {nbytes}")
        region = Region(name, self.end, nbytes, align_up(max(nbytes, 1)), dtype, tuple(shape))
        self.regions[name] = region
        self.end = region.end
        return region

    def __getitem__(self, name: str) -> Region:
        try:
            return self.regions[name]
        except KeyError:
            raise KeyError(f"no region named {name!r} in the store layout") from None

    def __contains__(self, name: str) -> bool:
        return name in self.regions

    def to_json(self) -> dict:
        return {"end": self.end, "regions": [dict(asdict(r), shape=list(r.shape)) for r in self.regions.values()]}

    @classmethod
    def from_json(cls, data: dict) -> Layout:
        layout = cls(end=int(data["end"]))
        for r in data["regions"]:
            layout.regions[r["name"]] = Region(r["name"], int(r["offset"]), int(r["nbytes"]), int(r["capacity"]),
                                               r["dtype"], tuple(r["shape"]))
        return layout

    def digest(self) -> str:
        """A hash of the table, stored in the file header and the manifest to detect mismatches."""
        blob = json.dumps(self.to_json(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()
