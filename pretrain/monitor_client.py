"""Rank 0's side of the monitoring protocol: post each step's metrics, get the action back.

The service's address and token are read from RUN_DIR/monitor/. When the service cannot be
reached the trainer goes on: the client warns once, answers `continue`, and tries again (re-reading
the endpoint, so a restarted service is found) at the next step. NaN/Inf steps are never applied
to the weights either way: DeepSpeed's bf16 overflow check skips them.
"""

from __future__ import annotations

import http.client
import json
import sys
import urllib.parse
from pathlib import Path

from monitoring.protocol import CONTINUE, Action, ProtocolError, StepMetrics


class MonitorClient:
    def __init__(self, run_dir: str | Path, timeout: float = 2.0):
        self.monitor_dir = Path(run_dir) / "monitor"
        self.timeout = timeout
        self.token: str | None = None
        self.connection: http.client.HTTPConnection | None = None  # kept alive between steps
        self.unreachable_since: int | None = None
        self.last_response: dict = {}

    def _connect(self) -> None:
        endpoint = json.loads((self.monitor_dir / "endpoint.json").read_text())
        self.token = (self.monitor_dir / "token").read_text().strip()
        address = urllib.parse.urlsplit(endpoint["url"])
        self.connection = http.client.HTTPConnection(address.hostname, address.port, timeout=self.timeout)

    def _post(self, path: str, payload: dict) -> dict:
        body = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"}
        self.connection.request("POST", path, body=body, headers=headers)
        response = self.connection.getresponse()
        answer = json.loads(response.read())
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}: {answer.get('error', answer)}")
        return answer

    def report(self, metrics: StepMetrics) -> Action:
        try:
            if self.connection is None:
                self._connect()
            self.last_response = self._post("/v1/metrics", metrics.to_json())
            action = Action.from_json({k: v for k, v in self.last_response.items() if k != "bands"})
        except (OSError, http.client.HTTPException, ValueError, KeyError, ProtocolError) as exc:
            if self.unreachable_since is None:
                self.unreachable_since = metrics.step
                print(f"warning: monitor unreachable at step {metrics.step} ({exc}); training goes on and "
                      "will reconnect", file=sys.stderr, flush=True)  # fmt: skip
            if self.connection is not None:
                self.connection.close()
            self.connection = None
            return CONTINUE
        if self.unreachable_since is not None:
            print(f"monitor reachable again at step {metrics.step}", file=sys.stderr, flush=True)
            self.unreachable_since = None
        return action

    def band(self, series: str) -> float | None:
        band = (self.last_response.get("bands") or {}).get(series)
        return band["threshold"] if band else None
