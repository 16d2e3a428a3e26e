"""The folder ampd's scheduler inside vLLM reads (workers.vllm.launch.StepSizing), written by
the supervisor: the engine's profile, its step target, and links to the ampd packages the
scheduler imports (so vLLM's environment gains those, not ampd's dependencies)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import perfmodel
import rounds
import surface
import workers
from perfmodel.profile import Profile
from workers.vllm.launch import StepSizing

# What workers.vllm.step_sizing and workers.vllm.connector import, with themselves.
PACKAGES = (perfmodel, rounds, surface, workers)


def prepare(sizing: StepSizing, profile: Profile, target_ms: float) -> None:
    packages = Path(sizing.packages)
    packages.mkdir(parents=True, exist_ok=True)
    for package in PACKAGES:
        link = packages / package.__name__
        if not link.exists():
            link.symlink_to(Path(package.__file__).resolve().parent, target_is_directory=True)
    Path(sizing.profile).write_text(profile.model_dump_json())
    set_target(sizing, target_ms)


def read_prices(sizing: StepSizing) -> dict[str, float]:
    """The scheduler's corrections of the profile's prices by step shape (empty before its first)."""
    try:
        return json.loads(Path(sizing.prices).read_text())
    except (OSError, ValueError):
        return {}


def set_target(sizing: StepSizing, target_ms: float) -> None:
    """The new target, replaced whole: the scheduler never reads half a number."""
    staged = Path(f"{sizing.target}.new")
    staged.write_text(f"{target_ms:g}\n")
    os.replace(staged, sizing.target)
