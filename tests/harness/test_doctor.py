"""`harness doctor` tells the truth about the delay line's TUN device: it opens it, as the user who runs."""

from __future__ import annotations

import errno
import os

import harness.doctor as doctor
from harness.net import delayline


def test_a_tun_device_this_user_cannot_open_is_a_no_with_the_fix(monkeypatch):
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if os.fspath(path) == delayline.TUN_DEVICE:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(doctor, "_docker_engine", lambda: (False, "skipped", False))
    monkeypatch.setattr(doctor, "_gpus", lambda: [])
    (line,) = [check for check in doctor.diagnose() if check.name == "delay line"]
    assert not line.ok
    assert "not usable by this user" in line.detail
    assert "needs to open /dev/net/tun read-write" in line.meaning and "chmod 0666 /dev/net/tun" in line.meaning
