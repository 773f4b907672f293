"""The on-disk fixture cache of ``tests/llm_fixtures.py`` under concurrent builders
(pytest-xdist workers, the GPU lane's parallel workers): each folder is built once, and no
caller sees it half made."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from tests.llm_fixtures import _publish


def _slow_build(out: Path, log: Path) -> None:
    with open(log, "a") as handle:
        handle.write("built\n")
    (out / "part").write_text("first half")
    time.sleep(0.3)
    (out / "done").write_text("ok")


def _caller(folder: str, log: str, results) -> None:
    made = _publish(Path(folder), "done", lambda out: _slow_build(out, Path(log)))
    results.put((made / "done").read_text())


def test_concurrent_callers_build_once_and_see_it_whole(tmp_path):
    folder, log = tmp_path / "model", tmp_path / "builds.log"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [
        context.Process(target=_caller, args=(str(folder), str(log), results)) for _ in range(4)
    ]
    for worker in workers:
        worker.start()
    seen = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    assert seen == ["ok"] * 4
    assert log.read_text().splitlines() == ["built"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["model"]


def test_half_made_folder_is_made_again(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "part").write_text("left by an interrupted run")
    _publish(folder, "done", lambda out: (out / "done").write_text("ok"))
    assert sorted(p.name for p in folder.iterdir()) == ["done"]


def test_failed_build_leaves_nothing(tmp_path):
    def broken(out: Path) -> None:
        (out / "part").write_text("x")
        raise RuntimeError("builder failed")

    with pytest.raises(RuntimeError, match="builder failed"):
        _publish(tmp_path / "model", "done", broken)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == []
