"""Recipe classes with the constructor argument megatron_lite passes (fp8_format)."""

import enum
from dataclasses import dataclass


class Format(enum.Enum):
    E4M3 = "e4m3"
    HYBRID = "hybrid"


@dataclass
class _Recipe:
    fp8_format: Format = Format.HYBRID


class DelayedScaling(_Recipe):
    pass


class Float8CurrentScaling(_Recipe):
    pass


class Float8BlockScaling(_Recipe):
    pass


class MXFP8BlockScaling(_Recipe):
    pass
