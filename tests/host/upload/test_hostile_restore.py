"""``esi-sidecar restore --to <the job's folder>`` run as root (issue 35, red team 5): the
job may rename the restore's temporary folder away and put a link to a root-only folder in
its place, or make an entry under the checkpoint's name, while the copy runs. No write may
follow such a link, the restored files belong to the folder's owner, and interference
ends in one line, never a traceback. Volume and S3 (moto on loopback), the function and
the command.

The job acts at a fixed moment, not by luck: the copy (``copy_verified``, as each restore
module calls it) is wrapped so that the job's move happens right before or right after the
files are written, while the temporary folder is there and before the commit.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
from upload_support import MIB, S3Server, commit_to_s3, isolate_aws_env, make_checkpoint

from sidecar.checkpoint.folders import LATEST_NAME, latest_valid
from sidecar.cli import main
from sidecar.host.upload import follow_place, restore, volume
from sidecar.host.upload.fetch import restore_newest
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.volume import RestoreError

JOB_UID = 65534  # nobody: the training job
NAME = "step_00000007"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="plays root and the job's uid")


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    isolate_aws_env(monkeypatch)
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """The job's folder (owned by the job) and a root-only folder (think /etc/cron.d)."""
    job = tmp_path / "job"
    job.mkdir()
    os.chown(job, JOB_UID, JOB_UID)
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    return job, secret


def swap_temp_for_link(job: Path, aim: Path) -> list[str]:
    """The job's move: every hidden temporary folder in its folder renamed away and a
    link to ``aim`` put in its place. Returns the names it swapped."""
    swapped: list[str] = []
    for name in os.listdir(job):
        if name.startswith(".tmp-") and not os.path.islink(job / name):
            os.rename(job / name, job / f".moved{len(swapped)}")
            os.symlink(aim, job / name)
            swapped.append(name)
    return swapped


def job_acts(monkeypatch: pytest.MonkeyPatch, module: Any, when: str,
             act: Callable[[], object]) -> list[object]:
    """``act`` runs right ``before`` or ``after`` the restore in ``module`` writes the files;
    returns the list of what it returned."""
    real = module.copy_verified
    done: list[object] = []

    def copy(*args: Any, **kwargs: Any) -> Any:
        if when == "before":
            done.append(act())
        result = real(*args, **kwargs)
        if when == "after":
            done.append(act())
        return result

    monkeypatch.setattr(module, "copy_verified", copy)
    return done


def on_volume(tmp_path: Path) -> str:
    make_checkpoint(tmp_path / "volume", 7, {"a.bin": 2 * MIB, "zz-cron": 40,
                                             "dcp/shard.bin": 3000})
    return (tmp_path / "volume").as_uri()


def on_s3(s3: S3Server, location: S3Location, tmp_path: Path) -> str:
    info = make_checkpoint(tmp_path / "source", 7, {"a.bin": 2 * MIB, "zz-cron": 40,
                                                    "dcp/shard.bin": 3000})
    commit_to_s3(s3, location, info)
    return location.url


def assert_restored_for_the_job(job: Path, secret: Path) -> None:
    assert os.listdir(secret) == []  # nothing was written through the link
    found = latest_valid(job, verify_checksums=True, clean=False)
    assert found is not None and found.name == NAME
    for path in [job / NAME, *(job / NAME).rglob("*"), job / LATEST_NAME]:
        mode = os.lstat(path)
        assert (mode.st_uid, mode.st_gid) == (JOB_UID, JOB_UID), path
        assert not stat.S_ISLNK(mode.st_mode)
    assert (job / LATEST_NAME).read_text() == f"{NAME}\n"


@needs_root
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_volume_restores_temp_folder_swapped_for_a_link_redirects_no_write(
    tmp_path: Path, folders: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    job, secret = folders
    source = on_volume(tmp_path)
    swaps = job_acts(monkeypatch, volume, when, lambda: swap_temp_for_link(job, secret))
    restored = restore_newest(source, job, {})
    assert swaps and swaps[0], "the job found no temporary folder to swap"
    assert restored.info.path == job / NAME and not restored.already_present
    assert_restored_for_the_job(job, secret)


@needs_root
@pytest.mark.parametrize("when", ["before", "after"])
def test_an_s3_restores_temp_folder_swapped_for_a_link_redirects_no_write(
    s3: S3Server, bucket: S3Location, tmp_path: Path, folders: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch, when: str,
) -> None:
    job, secret = folders
    on_s3(s3, bucket, tmp_path)
    swaps = job_acts(monkeypatch, restore, when, lambda: swap_temp_for_link(job, secret))
    restored = restore.restore(s3.storage(), bucket, job)
    assert swaps and swaps[0], "the job found no temporary folder to swap"
    assert restored.info.path == job / NAME
    assert_restored_for_the_job(job, secret)


def run_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.setenv("ESI_SIDECAR_UPLOAD_ACCESS_KEY", "testing")
    monkeypatch.setenv("ESI_SIDECAR_UPLOAD_SECRET_KEY", "testing")
    return main(["restore", *args])


@needs_root
@pytest.mark.parametrize("where", ["volume", "s3"])
def test_the_command_with_a_swapped_temp_folder_writes_nothing_outside(
    s3: S3Server, bucket: S3Location, tmp_path: Path, folders: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: str,
) -> None:
    job, secret = folders
    source = on_volume(tmp_path) if where == "volume" else on_s3(s3, bucket, tmp_path)
    module = volume if where == "volume" else restore
    swaps = job_acts(monkeypatch, module, "after", lambda: swap_temp_for_link(job, secret))
    code = run_cli(monkeypatch, "--from", source, "--to", str(job), "--endpoint", s3.endpoint)
    out, err = capsys.readouterr()
    assert swaps and swaps[0]
    assert code == 0 and err == "" and out.startswith(f"restored {NAME} (step 7, "), err
    assert_restored_for_the_job(job, secret)


@needs_root
@pytest.mark.parametrize("where", ["volume", "s3"])
def test_an_entry_the_job_makes_under_the_name_ends_the_command_in_one_line(
    s3: S3Server, bucket: S3Location, tmp_path: Path, folders: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: str,
) -> None:
    job, secret = folders
    source = on_volume(tmp_path) if where == "volume" else on_s3(s3, bucket, tmp_path)
    module = volume if where == "volume" else restore
    job_acts(monkeypatch, module, "after", lambda: os.symlink(secret, job / NAME))
    code = run_cli(monkeypatch, "--from", source, "--to", str(job), "--endpoint", s3.endpoint)
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{job / NAME} appeared while it was restored" in err
    assert os.listdir(secret) == [] and os.readlink(job / NAME) == str(secret)
    assert sorted(os.listdir(job)) == [NAME]  # nothing of the restore's left behind


@needs_root
def test_a_link_the_job_made_as_the_target_folder_is_refused(
    tmp_path: Path, folders: tuple[Path, Path]
) -> None:
    job, secret = folders
    source = on_volume(tmp_path)
    link = job / "ckpt"  # --to names a folder inside the job's: the job aims it at /etc
    os.symlink(secret, link)
    os.lchown(link, JOB_UID, JOB_UID)
    with pytest.raises(RestoreError, match="a symbolic link another user made"):
        restore_newest(source, link, {})
    assert os.listdir(secret) == []
    mine = tmp_path / "mine"  # the operator's own link is followed
    os.symlink(job, mine)
    assert restore_newest(source, mine, {}).info.name == NAME
    assert_restored_for_the_job(job, secret)


# ------------------------------------------------------------------- the follower's retire


@needs_root
def test_retire_never_removes_an_entry_the_job_put_under_the_name(
    folders: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The follower removes its previous copy by name once the inode matches; the job may
    replace it (a save of the same name) between that check and the rename."""
    job, _ = folders
    (job / NAME).mkdir()
    inode = os.lstat(job / NAME).st_ino
    real = follow_place.rename_no_replace

    def job_saves_first(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
        if src == NAME and not (job / ".old").exists():
            os.rename(job / NAME, job / ".old")
            (job / NAME).mkdir()
            (job / NAME / "model.pt").write_bytes(b"the job's new save")
        real(src_fd, src, dst_fd, dst)

    monkeypatch.setattr(follow_place, "rename_no_replace", job_saves_first)
    root_fd = os.open(job, os.O_RDONLY | os.O_DIRECTORY)
    try:
        follow_place.retire(root_fd, NAME, inode)
    finally:
        os.close(root_fd)
    assert (job / NAME / "model.pt").read_bytes() == b"the job's new save"
