"""Progress bars: drawn on a terminal (stages named, a timed bar completed when its call returns), silent elsewhere."""

from __future__ import annotations

import time

import aaflow.common.progress as progress


def test_stages_name_each_stage_and_end_full(monkeypatch, capsys):
    monkeypatch.setattr(progress, "_terminal", lambda: True)
    stages = progress.Stages(3, "calibrating")
    for label in ("prefill", "decode", "links"):
        stages.begin(label)
    assert stages.bar.n == 2  # two stages ended, the third under way
    stages.close()
    assert stages.bar.n == 3
    drawn = capsys.readouterr().err
    assert "calibrating" in drawn and "links" in drawn


def test_a_timed_bar_completes_when_its_call_returns_early(monkeypatch, capsys):
    monkeypatch.setattr(progress, "_terminal", lambda: True)
    with progress.timed("building a kernel", expected_s=30) as bar:
        time.sleep(0.6)
        assert 0 <= bar.n < 30
    assert bar.n == 30
    assert "about 30 s expected" in capsys.readouterr().err


def test_nothing_drawn_off_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(progress, "_terminal", lambda: False)
    stages = progress.Stages(2, "bench serve")
    stages.begin("burst")
    stages.close()
    with progress.timed("building", 1):
        pass
    assert capsys.readouterr().err == ""
