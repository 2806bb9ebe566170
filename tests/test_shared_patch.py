"""fulmen.core.shared_patch: one installation shared by nested and concurrent users, undone by the last to leave."""

import threading

import pytest

from fulmen.core.shared_patch import SharedPatch


def test_first_user_installs_last_user_uninstalls_and_nesting_shares_one_installation():
    calls = []
    patch = SharedPatch(lambda: calls.append("install"), lambda: calls.append("uninstall"))
    assert not patch.active
    with patch:
        with patch:
            assert patch.active and calls == ["install"]
        assert calls == ["install"]
    assert calls == ["install", "uninstall"] and not patch.active


def test_an_exception_inside_still_uninstalls():
    calls = []
    patch = SharedPatch(lambda: calls.append("install"), lambda: calls.append("uninstall"))
    with pytest.raises(ValueError), patch:
        raise ValueError("inside")
    assert calls == ["install", "uninstall"]


def test_concurrent_users_share_one_installation():
    calls = []
    patch = SharedPatch(lambda: calls.append("install"), lambda: calls.append("uninstall"))
    entered, release = threading.Barrier(3), threading.Event()

    def user():
        with patch:
            entered.wait()
            release.wait()

    threads = [threading.Thread(target=user) for _ in range(2)]
    for t in threads:
        t.start()
    entered.wait()
    assert calls == ["install"] and patch.active
    release.set()
    for t in threads:
        t.join()
    assert calls == ["install", "uninstall"]
