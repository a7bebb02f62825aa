"""``python -m lightning_nvme.doctor PATH ...``: the same as ``lightning-nvme doctor PATH ...``."""

import sys

from lightning_nvme.doctor.command import main

sys.exit(main())
