"""The demo (the project's current main job) runs end to end and exits 0."""

from __future__ import annotations

import pytest

from kvtier import demo


def test_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(["--blocks", "16", "--block-size", "4"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    # node-a: 16 blocks computed, tail quarter evicted from GPU, first half offloaded to CPU.
    assert "node-a: gpu  12  cpu   8  any tier  12  with predictions  12  (of 16 blocks)" in out
    # node-b: the system prompt (first half), plus a prediction over the whole prompt.
    assert "node-b: gpu   8  cpu   0  any tier   8  with predictions  16  (of 16 blocks)" in out
    assert "replayed 2" in out
