// The TypeScript client @durable-streams/client through a whole journey against a real
// PicoMQ, for tests/test_ts_client.py:
//
//   node ts_client_journey.mjs BASE_URL STREAM_PATH LIVE_MODE   (sse or long-poll)
//
// create, append, catch up, follow live, lose the server (prints "RESTART" and waits
// for "RESTARTED" on stdin while the test restarts it), append, disconnect, append,
// resume from the saved offset, close. Every message must arrive exactly once and in
// order. Exits non-zero with the reason on stderr; every wait has a deadline.

import { createInterface } from 'node:readline';
import { DurableStream, stream } from '@durable-streams/client';

const [baseUrl, path, live] = process.argv.slice(2);
const url = `${baseUrl}/v1/stream/${path}`;
const WAIT_MS = 20_000;
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
const message = (n) => ({ n, text: `message ${n}` });
const numbers = (first, last) => Array.from({ length: last - first + 1 }, (_, i) => first + i);
const retryForever = {
  onError: async () => ({}), // network errors while the server is away: retry, same offset
  backoffOptions: { initialDelay: 100, maxDelay: 1000, multiplier: 2, maxRetries: Infinity },
};

function check(condition, text) {
  if (!condition) throw new Error(text);
}

async function until(condition, what) {
  const deadline = Date.now() + WAIT_MS;
  while (!condition()) {
    check(Date.now() < deadline, `timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

// A live reader: collects items and the offset after them, until closed or aborted.
function follow(offset) {
  const reader = { items: [], offset, closed: false, controller: new AbortController() };
  reader.ready = stream({ url, offset, live, signal: reader.controller.signal, ...retryForever })
    .then((response) => {
      response.subscribeJson(async (batch) => {
        reader.items.push(...batch.items.map((item) => item.n));
        reader.offset = batch.offset;
        reader.closed ||= batch.streamClosed;
      });
    });
  return reader;
}

async function appendAll(writer, first, last) {
  for (const n of numbers(first, last)) await writer.append(JSON.stringify(message(n)));
}

// Node ends on an unhandled error anyway; say so on one line, with where it came from.
for (const event of ['unhandledRejection', 'uncaughtException']) {
  process.on(event, (error) => {
    console.error(`${event}: ${error?.stack ?? error} ${error?.cause?.code ?? ''}`);
    process.exit(1);
  });
}

const writer = await DurableStream.create({ url, contentType: 'application/json' });
await appendAll(writer, 1, 3);

const catchUp = await stream({ url, live: false });
const history = await catchUp.json();
check(JSON.stringify(history) === JSON.stringify(numbers(1, 3).map(message)),
  `catch-up read ${JSON.stringify(history)}`);

const first = follow(catchUp.offset);
await first.ready;
await appendAll(writer, 4, 5);
await until(() => first.items.length === 2, 'live messages 4 and 5');

console.log('RESTART'); // the test kills the server under the open live read and starts it
const answer = await lines.next();
check(answer.value === 'RESTARTED', `test answered ${JSON.stringify(answer)}`);
await appendAll(writer, 6, 6);
await until(() => first.items.length === 3, 'message 6 after the restart');

first.controller.abort(); // the reader goes away; the stream goes on
await appendAll(writer, 7, 8);

const second = follow(first.offset);
await second.ready;
await appendAll(writer, 9, 9);
const closed = await writer.close();
await until(() => second.closed, 'the resumed reader to see the stream closed');

const received = [...first.items, ...second.items];
check(JSON.stringify(received) === JSON.stringify(numbers(4, 9)),
  `live readers got ${JSON.stringify(received)}, expected 4..9 once each`);
check(second.offset === closed.finalOffset,
  `reader ended at ${second.offset}, the stream at ${closed.finalOffset}`);

let refused = null;
try {
  await writer.append(JSON.stringify(message(10)));
} catch (error) {
  refused = error;
}
check(refused !== null, 'an append to a closed stream succeeded');
console.log(`OK ${received.length} live messages, final offset ${second.offset}`);
process.exit(0);
