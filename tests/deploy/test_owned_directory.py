"""The leaf spool is this user's alone (privacy audit 3, F9): made 0700, and an existing directory
that others may write, or that another user owns, is refused by the leaf and by its bridge."""

from __future__ import annotations

import os
import stat

import pytest

from fedge.deploy.owned_directory import UnsafeDirectoryError, owned_directory


def test_a_new_spool_is_private_and_a_shared_one_is_refused(tmp_path) -> None:
    made = owned_directory(tmp_path / "spool")
    assert stat.S_IMODE(made.stat().st_mode) & 0o077 == 0
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeDirectoryError, match="writable by its group or by others"):
        owned_directory(shared)
    from fedge.edge_client.bridge import SpoolChannel

    with pytest.raises(UnsafeDirectoryError):
        SpoolChannel(shared)
    os.chmod(shared, 0o755)
    assert owned_directory(shared) == shared  # the owner's, not writable by others: used


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to make another user's directory")
def test_another_users_spool_is_refused(tmp_path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(UnsafeDirectoryError, match="belongs to user 12345"):
        owned_directory(theirs)
