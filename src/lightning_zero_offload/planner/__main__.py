"""``python -m lightning_zero_offload.planner``: the ``lzo-plan`` command."""

import sys

from lightning_zero_offload.planner.cli import main

sys.exit(main())
