"""The hardware catalogue lives in `ptdp.hardware` (the trainer's metrics read it without
importing the planner); this name stays so existing imports keep working."""

from ptdp.hardware import (HARDWARE_DIR, Efficiency, HardwareError, HardwareProfile,  # noqa: F401
                           available_hardware, foreign_profile, load_hardware,
                           machine_fingerprint, profile_from_dict, save_hardware)
