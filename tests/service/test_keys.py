"""API keys rotate without a restart and are counted under an id that is not the key: the keyring alone (ids,
constant-time match, the rate-limited re-read, a bad file keeping the last good keys, reload for SIGHUP), and
a live server on the tiny checkpoint whose key file is rewritten under it."""

from __future__ import annotations

import hashlib
import logging
import os
import time

import httpx
import pytest

from service import keys as keys_module
from service.keys import KeyRing, key_id
from tests.service.conftest import live_server

OLD, NEW, NEWER, LISTED = "old-key-0123456789", "new-key-abcdefghij", "newer-key-klmnopqrs", "listed-key-zz"


def write_keys(path, *keys: str, atomic: bool = True) -> None:
    """As a Kubernetes Secret update does (a new file swapped in), or in place."""
    text = "# qtrel keys\n" + "".join(f"{k}\n" for k in keys)
    if atomic:
        tmp = path.with_suffix(".new")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    else:
        path.write_text(text, encoding="utf-8")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_key_id_is_a_short_sha256_never_the_key(tmp_path):
    path = tmp_path / "keys"
    write_keys(path, OLD, OLD)
    ring = KeyRing((LISTED,), path)
    assert key_id(OLD) == hashlib.sha256(OLD.encode()).hexdigest()[:12]
    assert ring.keys == (LISTED, OLD, OLD) and ring.ids == (key_id(LISTED), key_id(OLD))
    assert ring.match(OLD) == key_id(OLD) and ring.match(LISTED) == key_id(LISTED)
    assert ring.match(OLD + "x") is None and ring.match("") is None and ring.match(OLD[:-1]) is None
    assert not any(OLD in i or i in OLD for i in ring.ids)


def test_match_compares_with_every_key(monkeypatch):
    calls = []
    real = keys_module.hmac.compare_digest

    def counting(a, b):
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(keys_module.hmac, "compare_digest", counting)
    ring = KeyRing(("k1", "k2", "k3"), None)
    assert ring.match("k1") == key_id("k1") and len(calls) == 3  # the first one matched: no early exit
    calls.clear()
    assert ring.match("nope") is None and len(calls) == 3
    assert KeyRing((), None).match("k") is None and KeyRing((), None).keys == ()


def test_the_file_is_re_read_when_it_changes_at_most_once_per_interval(tmp_path):
    path, clock = tmp_path / "keys", Clock()
    write_keys(path, OLD)
    ring = KeyRing((LISTED,), path, check_every_s=1.0, clock=clock)
    write_keys(path, NEW)
    ring.refresh()
    assert ring.keys == (LISTED, OLD) and ring.generation == 0  # within the interval: not looked at
    clock.now += 1.0
    ring.refresh()
    assert ring.keys == (LISTED, NEW) and ring.generation == 1
    write_keys(path, NEW, NEWER, atomic=False)  # rewritten in place
    clock.now += 1.0
    ring.refresh()
    assert ring.keys == (LISTED, NEW, NEWER) and ring.generation == 2
    clock.now += 1.0
    ring.refresh()  # unchanged: nothing re-read
    assert ring.generation == 2


def test_a_bad_file_on_re_read_keeps_the_last_good_keys_and_logs_one_error(tmp_path, caplog):
    path, clock = tmp_path / "keys", Clock()
    write_keys(path, OLD)
    ring = KeyRing((), path, clock=clock)
    caplog.set_level(logging.INFO, logger="qtrel.keys")
    for bad in ("only comments", "missing"):
        if bad == "missing":
            path.unlink()
        else:
            write_keys(path)
        for _ in range(3):
            clock.now += 1.0
            ring.refresh()
        ring.reload()  # SIGHUP on a bad file: the same error, not logged again
        assert ring.keys == (OLD,) and ring.match(OLD) == key_id(OLD)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and "holds no key" in errors[0] and "FileNotFoundError" in errors[1]
    assert all("the 1 keys read before stay in force" in e and OLD not in e for e in errors)
    write_keys(path, NEW)
    clock.now += 1.0
    ring.refresh()
    assert ring.keys == (NEW,)


def test_reload_re_reads_at_once(tmp_path):
    """What SIGHUP calls: no wait for the interval, even for a change the stat check would not see."""
    path = tmp_path / "keys"
    write_keys(path, OLD)
    ring = KeyRing((), path, check_every_s=3600)
    write_keys(path, NEW, atomic=False)
    ring.refresh()
    assert ring.keys == (OLD,)
    ring.reload()
    assert ring.keys == (NEW,) and ring.generation == 1


def info(srv, key: str) -> int:
    return httpx.get(srv.url + "/info", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code


def wait_for(check, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.1)


@pytest.fixture
def key_server(tiny_checkpoint, tmp_path):
    path = tmp_path / "keys"
    write_keys(path, OLD)
    with live_server(tiny_checkpoint, worker="thread", api_keys=LISTED, api_keys_file=str(path)) as srv:
        yield srv, path


def test_rotating_the_key_file_under_a_live_server_needs_no_restart(key_server, caplog):
    srv, path = key_server
    assert info(srv, OLD) == 200 and info(srv, NEW) == 401
    write_keys(path, NEW)
    wait_for(lambda: info(srv, NEW) == 200)
    assert info(srv, OLD) == 401 and info(srv, LISTED) == 200
    assert srv.engine.settings.keys == (LISTED, NEW)
    caplog.set_level(logging.INFO, logger="qtrel.keys")
    path.unlink()  # a Secret gone missing: the last good keys keep serving
    for _ in range(2):  # two re-read checks: one error
        time.sleep(1.1)
        assert info(srv, NEW) == 200 and info(srv, OLD) == 401
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1
    write_keys(path, NEWER)
    wait_for(lambda: info(srv, NEWER) == 200)
    assert info(srv, NEW) == 401


def test_requests_are_counted_per_key_id_for_the_keys_in_force(key_server):
    srv, path = key_server
    for key, n in ((OLD, 3), (LISTED, 1)):
        for _ in range(n):
            assert info(srv, key) == 200
    assert info(srv, "wrong") == 401
    name = "qtrel_requests_by_key_total"
    assert srv.metric(name, key_id=key_id(OLD)) == 3 and srv.metric(name, key_id=key_id(LISTED)) == 1
    assert srv.metric(name) == 4
    write_keys(path, NEW)
    wait_for(lambda: info(srv, NEW) == 200)
    text = httpx.get(srv.url + "/metrics").text
    assert f'{name}{{key_id="{key_id(NEW)}"}} 1.0' in text
    assert key_id(OLD) not in text and key_id(LISTED) in text  # a key no longer in force loses its series
    assert not any(k in text for k in (OLD, NEW, LISTED))
