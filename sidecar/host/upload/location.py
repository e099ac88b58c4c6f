"""Where checkpoints go: ``s3://bucket/prefix`` and its key layout, or ``file:///mounted/volume``
(standard library only).

A local checkpoint folder ``root/step_00000100/`` becomes the remote folder
``prefix/step_00000100/`` holding the same relative paths, and ``MANIFEST.json`` is
uploaded last: a remote checkpoint is complete if and only if its manifest exists.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from sidecar.checkpoint.manifest import MANIFEST_NAME

__all__ = ["S3Location", "parse_destination", "parse_s3_url", "parse_volume_url"]

# S3's rules, loosely: 3-63 characters, lower case, digits, dots and hyphens. TOS follows
# the same rules. Checked here so a typo stops start-up instead of every upload.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # no leading or trailing '/'; may be empty (the bucket's top)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @property
    def listing_prefix(self) -> str:
        """The key prefix under which every checkpoint folder lies ('' or 'prefix/')."""
        return f"{self.prefix}/" if self.prefix else ""

    def folder(self, name: str) -> str:
        """Key prefix of one checkpoint folder, ending in '/'."""
        return f"{self.listing_prefix}{name}/"

    def key(self, name: str, relative: str) -> str:
        return self.folder(name) + relative

    def manifest_key(self, name: str) -> str:
        return self.key(name, MANIFEST_NAME)

    def __str__(self) -> str:
        return self.url


def parse_s3_url(text: str) -> S3Location:
    """``s3://bucket/some/prefix`` -> S3Location; raises ValueError with the reason."""
    text = text.strip()
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in ("s3", "tos"):
        raise ValueError("expected s3://BUCKET/PREFIX")
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ValueError(f"not a valid bucket name: {bucket!r}")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ValueError(f"the prefix has an empty, '.' or '..' part: {prefix!r}")
    return S3Location(bucket, prefix)


def parse_volume_url(text: str) -> Path:
    """``file:///mnt/share/run-42`` -> the absolute path of a mounted volume's folder."""
    text = text.strip()
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() != "file":
        raise ValueError("expected file:///ABSOLUTE/PATH")
    host, slash, path = rest.partition("/")
    if host not in ("", "localhost") or not slash:
        raise ValueError("a file:// URL names a folder on this host: file:///mnt/share/run")
    folder = Path("/" + urllib.parse.unquote(path)).resolve()
    if folder == Path("/"):
        raise ValueError("not the root folder: name the run's folder on the volume")
    return folder


def parse_destination(text: str) -> Union[S3Location, Path]:
    """``s3://...`` (S3 / TOS), ``file:///...`` or a plain absolute path (a mounted volume's
    folder, as ``restore --from /mnt/share/run`` is typed); ValueError otherwise."""
    if text.strip().lower().startswith("file:"):
        return parse_volume_url(text)
    if text.strip().startswith("/"):
        return parse_volume_url(Path(text.strip()).as_uri())
    try:
        return parse_s3_url(text)
    except ValueError as exc:
        raise ValueError(f"{exc}, or file:///PATH (or /PATH) for a mounted volume") from None
