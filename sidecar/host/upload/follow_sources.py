"""Where the follower reads durable checkpoints from: a mounted volume or S3 / TOS, one
object each (``newest``, ``fetch``), over the restore's own primitives.

``fetch`` writes the files it is given (those that changed since the follower's last copy)
into ``private_root/<name>`` with the checkpoint's manifest, checked against it while
copied (sizes, sha256): the volume through ``volume.copy_checkpoint``, S3 through
``transfer.download_files`` and ``volume.check_copy``, the folder committed with
``volume.commit_folder`` as ``esi-sidecar restore`` commits. ``private_root`` is the
follower's own folder (root's, mode 0700): nothing of the job's can be in it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from sidecar.checkpoint.manifest import MANIFEST_NAME, CheckpointInfo, FileEntry, read_listed
from sidecar.host.upload.volume import (
    check_copy,
    commit_folder,
    copy_checkpoint,
    newest_on_volume,
)

__all__ = ["Durable", "FollowSource", "S3Source", "VolumeSource"]


@dataclass(frozen=True)
class Durable:
    """The newest durable checkpoint at the destination."""

    name: str
    manifest: bytes
    info: CheckpointInfo  # files as the manifest lists them


class FollowSource(Protocol):
    @property
    def url(self) -> str: ...

    def newest(self) -> Optional[Durable]: ...

    def fetch(self, found: Durable, files: tuple[FileEntry, ...], private_root: Path,
              should_stop: Callable[[], Optional[str]]) -> Path: ...


def _only(info: CheckpointInfo, files: tuple[FileEntry, ...]) -> CheckpointInfo:
    return dataclasses.replace(info, files=files)


@dataclass
class VolumeSource:
    """A mounted volume laid out as a checkpoint root (``file:///PATH``)."""

    root: Path
    max_bandwidth: Optional[int] = None

    @property
    def url(self) -> str:
        return self.root.as_uri()

    def newest(self) -> Optional[Durable]:
        info = newest_on_volume(self.root)
        if info is None:
            return None
        return Durable(info.name, read_listed(info.path, MANIFEST_NAME), info)

    def fetch(self, found: Durable, files: tuple[FileEntry, ...], private_root: Path,
              should_stop: Callable[[], Optional[str]]) -> Path:
        return copy_checkpoint(_only(found.info, files), found.manifest, private_root,
                               should_stop=should_stop, max_bandwidth=self.max_bandwidth)


class S3Source:
    """S3 / TOS (``s3://BUCKET/PREFIX``): boto3, made on first use."""

    def __init__(self, storage: Any, location: Any,
                 client_factory: Optional[Callable[[Any], Any]] = None) -> None:
        from sidecar.host.upload.storage import make_client

        self.storage = storage
        self.location = location
        self._factory = client_factory or make_client
        self._client: Optional[Any] = None

    @property
    def url(self) -> str:
        return str(self.location.url)

    def _connected(self) -> Any:
        if self._client is None:
            self._client = self._factory(self.storage)
        return self._client

    def newest(self) -> Optional[Durable]:
        from sidecar.host.upload.restore import find_complete

        found, _ = find_complete(self._connected(), self.location)
        return None if found is None else Durable(found.name, found.manifest, found.info)

    def fetch(self, found: Durable, files: tuple[FileEntry, ...], private_root: Path,
              should_stop: Callable[[], Optional[str]]) -> Path:
        from sidecar.host.upload.s3_refs import read_references
        from sidecar.host.upload.transfer import download_files

        client = self._connected()
        references = read_references(client, self.location, found.name)
        wanted = _only(found.info, files)

        def fill(temp: Path) -> None:
            download_files(client, self.storage, self.location, wanted, temp,
                           should_stop=should_stop,
                           references=references)
            check_copy(wanted, True)(temp)

        return commit_folder(private_root, found.name, found.manifest, fill)
