"""Where the uploader sends complete checkpoints: the one interface both kinds keep.

S3 / TOS (``transfer.S3Destination``) and a mounted volume (``volume.VolumeDestination``);
the commit loop (``uploader``) and the idle work (``idle``) both talk to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Optional, Protocol

from sidecar.checkpoint.folders import CheckpointInfo
from sidecar.host.upload.commit_check import DurableFile, Staging

__all__ = ["Destination"]


class Destination(Protocol):
    """Where complete checkpoints go: S3 / TOS (``transfer.S3Destination``) or a mounted
    volume (``volume.VolumeDestination``). Each keeps the manifest-last guarantee."""

    @property
    def url(self) -> str: ...

    @property
    def endpoint(self) -> Optional[str]: ...

    @property
    def where(self) -> str: ...

    def prepare(self, started_at_unix: float) -> None: ...

    def remote_manifest(self, name: str) -> Optional[bytes]: ...

    def upload(self, info: CheckpointInfo, manifest: bytes, *,
               on_progress: Callable[[int], None], should_stop: Callable[[], Optional[str]],
               before_manifest: Callable[[], None], staging: Optional[Staging] = None,
               durable: Mapping[str, DurableFile] = ...) -> None: ...

    def describe_error(self, exc: BaseException, doing: str) -> str: ...

    def reset(self) -> None: ...

    def open_staging(self, name: str) -> Staging:
        """Where ``name``'s files go before its manifest lands (nothing visible)."""
        ...

    def durable_files(self, name: str) -> dict[str, DurableFile]:
        """The files of the durable checkpoint ``name`` with a known sha256."""
        ...

    def probe(self, amount: int, should_stop: Callable[[], Optional[str]]) -> None:
        """Send ``amount`` bytes where nothing reads them (``probe.LinkProbe``)."""
        ...

    def make_self_contained(self, name: str, should_stop: Callable[[], Optional[str]]) -> int:
        """Bring into ``name``'s folder the files it refers to elsewhere (``s3_refs``)."""
        ...
