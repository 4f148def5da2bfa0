"""`cgpuctl runtime configure --nvidia-toolkit`: the NVIDIA container
toolkit's config.toml set so that a container gets GPUs only from what cgpud
hands out, never from its own env. Pure: file text in, FileChange out.

The toolkit gives a container GPUs by NVIDIA_VISIBLE_DEVICES, which any
image sets (every nvidia/cuda image: `all`). With
`accept-nvidia-visible-devices-envvar-when-unprivileged = false` it ignores
that variable in unprivileged containers and reads the device list from
volume mounts at /var/run/nvidia-container-devices/<device> instead
(`accept-nvidia-visible-devices-as-volume-mounts = true`), which a pod spec
cannot name but a device plugin's Allocate answer can: cgpud's names exactly
an instance's GPUs (cgpud/kube/allocator.py)."""

from __future__ import annotations

from pathlib import Path

import tomlkit
from tomlkit.exceptions import TOMLKitError

from cgpud.cli.config_change import FileChange
from cgpud.errors import UsageError

TOOLKIT_CONFIG = Path("/etc/nvidia-container-runtime/config.toml")
SETTINGS = {
    "accept-nvidia-visible-devices-envvar-when-unprivileged": False,
    "accept-nvidia-visible-devices-as-volume-mounts": True,
}


def toolkit_changes(path: Path, text: str | None) -> list[FileChange]:
    """The toolkit's config with the two settings, every other line kept."""
    try:
        doc = tomlkit.parse(text or "")
    except TOMLKitError as e:
        raise UsageError(f"{path} is not TOML ({e}): fix it first, nothing was changed") from None
    for key, value in SETTINGS.items():
        if doc.get(key) != value:
            doc[key] = value
    return [FileChange(path, text, tomlkit.dumps(doc))]


def toolkit_gaps(path: Path, text: str) -> list[str]:
    """The settings of SETTINGS the toolkit's config does not have as
    cgpu needs them, as `key = value` lines to set (the toolkit's defaults
    are the unsafe ones: an absent key counts as wrong)."""
    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as e:
        raise UsageError(f"{path} is not TOML ({e})") from None
    return [f"{key} = {str(value).lower()}" for key, value in SETTINGS.items() if doc.get(key) != value]
