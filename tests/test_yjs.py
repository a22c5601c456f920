"""The protocol authors' Yjs provider `@durable-streams/y-durable-streams` (npm, pinned in
tests/node) syncing documents through a real PicoMQ, by way of the `YjsServer` it ships:
two docs edit concurrently and converge, see each other's presence, go on after a graceful
restart of PicoMQ, a late joiner loads the document, and new clients load snapshots that a
tiny compaction threshold makes. tests/node/yjs_journey.mjs does the Yjs side; this test
restarts the server when the driver asks.

That YjsServer reads from offsets PicoMQ never returned: a snapshot taken at offset X is
followed by a read of the updates from X plus one, which is inside the append that starts
at X, or past the tail when nothing came after the snapshot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from node_tools import NODE_DIR, drive_through_restart, install_node_packages

if TYPE_CHECKING:
    from conftest import StartServer

DRIVER_TIMEOUT_SECONDS = 90


def test_yjs_provider_journey(start_server: StartServer, unique_stream: str) -> None:
    install_node_packages()
    # Live reads end within a second, so the graceful restart does not wait long for them.
    server = start_server(env={"PICOMQ_SSE_MAX_DURATION": "1"})
    command = ["node", str(NODE_DIR / "yjs_journey.mjs"), server.url, unique_stream]
    returncode, output, errors = drive_through_restart(
        command, server.restart, DRIVER_TIMEOUT_SECONDS
    )
    assert returncode == 0, f"{output}\n{errors}"
    assert output.startswith("OK 6 items converged through a restart"), output
