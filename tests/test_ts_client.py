"""The TypeScript client `@durable-streams/client` (npm, pinned in tests/node) through the
whole journey against a real PicoMQ, in both live modes: create, append, catch up,
follow live, lose the server (a crash, or a graceful restart) and get it back, append,
disconnect, append, resume from the saved offset, close. tests/node/ts_client_journey.mjs
does the client side and checks every message arrives once; this test stops the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from node_tools import NODE_DIR, drive_through_restart, install_node_packages

if TYPE_CHECKING:
    from conftest import StartServer

DRIVER_TIMEOUT_SECONDS = 120


@pytest.mark.parametrize(
    ("live", "stop"),
    [
        ("long-poll", "crash"),
        # 0.2.7's SSE reader dies with an unhandled "TypeError: terminated" when a response
        # is cut mid-body (a crash, a proxy): a client gap. A graceful restart ends every
        # SSE response cleanly at once, with a last control event, and that it follows.
        ("sse", "graceful"),
    ],
)
def test_typescript_client_journey(
    start_server: StartServer, unique_stream: str, live: str, stop: str
) -> None:
    install_node_packages()
    server = start_server(env={"PICOMQ_SSE_MAX_DURATION": "1"})
    command = ["node", str(NODE_DIR / "ts_client_journey.mjs"), server.url, unique_stream, live]

    def stop_and_start() -> None:
        if stop == "crash":
            server.kill9()  # under the client's open live read
            server.start()
        else:
            server.restart()  # SIGTERM: open live reads end at once, whole, then it stops

    returncode, output, errors = drive_through_restart(
        command, stop_and_start, DRIVER_TIMEOUT_SECONDS
    )
    assert returncode == 0, f"{output}\n{errors}"
    assert output.startswith("OK 6 live messages"), output
