"""The monitor's page (`GET /`), rendered by a real headless browser (Debian's `chromium`)."""

import json
import math
import os
import re
import shutil
import subprocess

import pytest

from tests.integration.test_monitoring import _start_service, request
from tests.unit.test_monitor import fake_checkpoint, metrics

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def browser(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            CHROMIUM,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--user-data-dir=/tmp/pretrain-chromium",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_the_page_shows_progress_bands_and_events_in_a_browser(tmp_path):
    process, url, token = _start_service(tmp_path, "monitor.warmup=8")
    try:
        fake_checkpoint(tmp_path, 40)
        for step in range(1, 61):
            grad = 1.0 + 0.05 * math.sin(step)
            if step == 30:
                grad *= 5  # above its band, below 8x its median: a warning
            if step == 55:
                grad *= 100  # a surge: a rollback
            report = metrics(step, loss=4.0 - 0.01 * step, grad=grad).to_json() | {"total_steps": 200}
            answer = json.loads(request(url, "/v1/metrics", report, token)[1])
        assert answer["verdict"]["level"] == "superseded"
        outcome = {"decision": 1, "decided_at": 55, "applied": True, "applied_at": 60, "tag": "step_00000040"}
        assert request(url, "/v1/outcome", outcome, token)[0] == 200
        for step in range(41, 50):
            request(
                url,
                "/v1/metrics",
                metrics(step, loss=4.0 - 0.01 * step).to_json() | {"total_steps": 200},
                token,
            )
        code, page = request(url, "/")
        assert (
            code == 200 and "<script" not in page and not re.search(r'(src|href)="(?!/)', page)
        )  # self-contained
        dom = browser("--dump-dom", url + "/").stdout
        assert "Training monitor" in dom and "49 / 200" in dom
        assert (
            dom.count("<svg") == 2 and dom.count('class="rollback"') == 2 and dom.count('class="warn"') == 2
        )
        assert "rollback applied" in dom and "decision 1 → step_00000040" in dom and "grad_norm spike" in dom
        screenshot = tmp_path / "page.png"
        browser(f"--screenshot={screenshot}", "--window-size=760,1150", "--hide-scrollbars", url + "/")
        assert screenshot.stat().st_size > 10_000
        if os.environ.get("PRETRAIN_SAVE_SCREENSHOT"):  # docs/monitor-page.png
            shutil.copy(screenshot, os.environ["PRETRAIN_SAVE_SCREENSHOT"])
    finally:
        process.terminate()
        process.wait(timeout=30)
