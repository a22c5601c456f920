// Runs the Durable Streams conformance suite against the PicoMQ at PICOMQ_URL.
// Started by tests/test_conformance.py; by hand:
//   PICOMQ_URL=http://127.0.0.1:8080 PICOMQ_LONG_POLL_MS=500 npx vitest run --root tests/conformance
import { runConformanceTests } from "@durable-streams/server-conformance-tests";

const baseUrl = process.env.PICOMQ_URL;
const longPollTimeoutMs = Number(process.env.PICOMQ_LONG_POLL_MS);
if (!baseUrl || !Number.isFinite(longPollTimeoutMs) || longPollTimeoutMs <= 0) {
  throw new Error("set PICOMQ_URL and PICOMQ_LONG_POLL_MS (the server's long-poll timeout in ms)");
}

runConformanceTests({ baseUrl, longPollTimeoutMs, subscriptions: true });
