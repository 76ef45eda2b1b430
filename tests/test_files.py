"""kernels/files.py: a directory committed over another is the old one or the new one at
every point, a crash included, and leaves nothing behind."""
import pytest

from kernels import files


def directory(path, text: str):
    path.mkdir()
    (path / "sub").mkdir()
    (path / "sub" / "f").write_text(text)
    return path


def content(path) -> str:
    return (path / "sub" / "f").read_text()


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "aside"])
def test_a_directory_committed_over_another_replaces_it_and_leaves_nothing_behind(tmp_path, monkeypatch, exchange):
    if not exchange:  # a system without renameat2
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    files.commit_directory(directory(tmp_path / ".new", "one"), tmp_path / "model")
    assert content(tmp_path / "model") == "one"
    files.commit_directory(directory(tmp_path / ".new", "two"), tmp_path / "model")
    assert content(tmp_path / "model") == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_without_replace_an_existing_directory_is_kept(tmp_path):
    directory(tmp_path / "model", "old")
    with pytest.raises(FileExistsError, match="already exists"):
        files.commit_directory(directory(tmp_path / ".new", "new"), tmp_path / "model", replace=False)
    assert content(tmp_path / "model") == "old" and content(tmp_path / ".new") == "new"


def test_a_crash_during_the_commit_leaves_the_old_or_the_new_directory_in_place(tmp_path, monkeypatch):
    if not files._exchange(directory(tmp_path / "a", "a"), directory(tmp_path / "b", "b")):
        pytest.skip("no atomic exchange on this system")
    directory(tmp_path / "model", "old")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(files, "fsync_path", crash)  # before anything is renamed
    with pytest.raises(KeyboardInterrupt):
        files.commit_directory(directory(tmp_path / ".new", "new"), tmp_path / "model")
    assert content(tmp_path / "model") == "old"
    monkeypatch.undo()
    monkeypatch.setattr(files.shutil, "rmtree", crash)  # after the swap, before the old one is removed
    with pytest.raises(KeyboardInterrupt):
        files.commit_directory(tmp_path / ".new", tmp_path / "model")
    assert content(tmp_path / "model") == "new" and content(tmp_path / ".new") == "old"
