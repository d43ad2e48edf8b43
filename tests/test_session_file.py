"""The worker's session file (pserver/worker/sessions.py) and the token file
(pserver/wire/security.py): private or refused, as ssh treats its keys; a full or read-only disk
costs the file, never the run."""

from __future__ import annotations

import os
import stat

import pytest

from pserver.errors import ConfigError
from pserver.wire.security import read_token_file, resolve_token, write_token_file
from pserver.worker.sessions import SessionFile, default_dir
from tests.support.processes import missing

PS = ["127.0.0.1:5000", "127.0.0.1:5001"]


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_kept_sessions_come_back_from_a_private_file(tmp_path):
    f = SessionFile(str(tmp_path / "s"), PS, 1)
    assert f.load() == {}                                    # nothing kept yet
    f.save([(PS[0], "i0", "a" * 32), (PS[1], "i1", "b" * 32)])
    assert mode(tmp_path / "s") == 0o700 and mode(f.path) == 0o600
    assert SessionFile(str(tmp_path / "s"), PS, 1).load() == {PS[0]: "a" * 32, PS[1]: "b" * 32}
    # another rank, or another cluster, has a file of its own
    assert SessionFile(str(tmp_path / "s"), PS, 0).load() == {}
    assert SessionFile(str(tmp_path / "s"), PS[::-1], 1).path != f.path
    assert os.listdir(tmp_path / "s") == [os.path.basename(f.path)]   # no temporary file left


def test_the_default_directory_follows_xdg_state_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_dir() == str(tmp_path / "pserver" / "sessions")
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_dir() == os.path.expanduser("~/.local/state/pserver/sessions")


@pytest.mark.parametrize("what", ["directory", "file"])
def test_a_session_file_or_directory_others_may_read_is_refused(tmp_path, what):
    f = SessionFile(str(tmp_path / "s"), PS, 0)
    f.save([(PS[0], "i", "a" * 32)])
    path = f.directory if what == "directory" else f.path
    os.chmod(path, 0o755 if what == "directory" else 0o644)
    want = "0700" if what == "directory" else "0600"
    with pytest.raises(ConfigError, match=rf"^--session-dir: {path} has mode 0[76][54][54]: others may read "
                                          rf"or change it; it must be {want} \(chmod {want[1:]} "):
        f.load()


def test_a_session_file_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        missing("the other-user session file test",
                "giving a file to another user needs root (CI runs as root)")
    f = SessionFile(str(tmp_path / "s"), PS, 0)
    f.save([(PS[0], "i", "a" * 32)])
    os.chown(f.path, 4242, -1)
    with pytest.raises(ConfigError, match="belongs to user id 4242, not to this user"):
        f.load()


def test_an_unwritable_directory_costs_the_file_not_the_run(tmp_path, capsys):
    (tmp_path / "plain").write_text("")
    f = SessionFile(str(tmp_path / "plain" / "sessions"), PS, 0)   # under a file: cannot exist
    f.save([(PS[0], "i", "a" * 32)])
    f.save([(PS[0], "i", "b" * 32)])
    out = capsys.readouterr().out
    assert out.count("cannot keep this worker's session") == 1, out   # said once
    assert "waits for its old session to expire" in out


def test_unreadable_or_foreign_contents_are_ignored(tmp_path):
    f = SessionFile(str(tmp_path), PS, 0)
    fd = os.open(f.path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"{not json")
    os.close(fd)
    assert f.load() == {}
    with open(f.path, "w") as out:
        out.write('{"rank": 0, "ps": ["127.0.0.1:5000", "127.0.0.1:5001"], "shards": [{"address": 5}]}')
    assert f.load() == {}


def test_a_process_removes_only_a_file_that_still_holds_its_own_sessions(tmp_path):
    f = SessionFile(str(tmp_path), PS, 0)
    f.save([(PS[0], "i", "new" * 8)])           # the process that took the rank over wrote this
    f.remove({PS[0]: "old" * 8})                # the displaced one leaves it
    assert os.path.exists(f.path)
    f.remove({PS[0]: "new" * 8})
    assert not os.path.exists(f.path)


def test_none_keeps_no_file(tmp_path):
    f = SessionFile("none", PS, 0)
    f.save([(PS[0], "i", "a" * 32)])
    assert f.path is None and f.load() == {}


def test_a_token_file_is_read_without_its_newline_and_only_if_private(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    path = write_token_file("s3cret-token", "t.token")
    assert path == str(tmp_path / "run" / "pserver" / "t.token")
    assert mode(path) == 0o600 and mode(tmp_path / "run" / "pserver") == 0o700
    assert read_token_file(path) == "s3cret-token"
    assert resolve_token(None, token_file=path) == "s3cret-token"
    with pytest.raises(ConfigError, match="give the token one way, not both"):
        resolve_token("other", token_file=path)
    with pytest.raises(ConfigError, match="--token-file: cannot write"):   # never over an existing one
        write_token_file("x", "t.token")
    os.chmod(path, 0o640)
    with pytest.raises(ConfigError, match=r"^--token-file: .* has mode 0640: others may read"):
        read_token_file(path)
    os.chmod(path, 0o600)
    with open(path, "w") as f:
        f.write("two words\n")
    with pytest.raises(ConfigError, match="printable ASCII characters without spaces") as e:
        read_token_file(path)
    assert "two" not in str(e.value)                 # an error never quotes the token


def test_an_auto_rank_slot_is_one_live_process_s_and_a_dead_one_s_rank_comes_back(tmp_path):
    """--rank auto: a slot's lock keeps a second auto worker out of a live one's slot (it would take
    that worker's rank over), and a slot whose holder died gives its rank and credentials back.
    Fails if two live workers share a slot, if the dead one's slot is not found again, or if the
    kept rank or credentials are lost."""
    d = str(tmp_path / "s")
    first = SessionFile.auto_slot(d, PS)
    assert first.rank == -1 and first.load() == {}              # nothing kept: shard 0 assigns one
    first.rank = 3
    first.save([(PS[0], "i0", "a" * 32), (PS[1], "i1", "b" * 32)])
    second = SessionFile.auto_slot(d, PS)                        # first is live: another slot
    assert second.path != first.path and second.rank == -1
    os.close(first.lock_fd)                                      # first dies: the system drops its lock
    again = SessionFile.auto_slot(d, PS)
    assert again.path == first.path and again.rank == 3
    assert again.load() == {PS[0]: "a" * 32, PS[1]: "b" * 32}
    assert SessionFile.auto_slot(d, PS[::-1]).rank == -1          # another cluster: its own slots
    assert SessionFile.auto_slot("none", PS).path is None


def test_an_auto_rank_slot_on_an_unwritable_directory_costs_the_file_not_the_run(tmp_path, capsys):
    (tmp_path / "plain").write_text("")
    slot = SessionFile.auto_slot(str(tmp_path / "plain" / "sessions"), PS)   # under a file: cannot exist
    assert slot.path is None and slot.rank == -1
    assert "a restart of it gets a new rank" in capsys.readouterr().out
