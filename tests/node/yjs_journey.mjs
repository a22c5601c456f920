// The protocol authors' Yjs provider, @durable-streams/y-durable-streams, syncing documents
// through a real PicoMQ, for tests/test_yjs.py:
//
//   node yjs_journey.mjs PICOMQ_URL SERVICE
//
// The package's own YjsServer runs here on a loopback port in front of PicoMQ (it keeps
// each document in streams under /v1/stream/yjs/SERVICE/docs/...), and YjsProviders
// connect to it. Two docs edit concurrently and converge, see each other's presence,
// lose PicoMQ to a graceful restart (prints "RESTART" and waits for "RESTARTED" on stdin
// while the test restarts it) and converge again; a late joiner loads the document. Then
// a YjsServer with a tiny compaction threshold takes snapshots, and new clients load a
// snapshot plus the updates after it, and a snapshot with nothing after it. That server
// continues from offsets PicoMQ never returned: the snapshot's offset plus one.
//
// stdout carries only RESTART and the final "OK ..."; the package's own logging goes to
// stderr. Exits non-zero with the reason on stderr; every wait has a deadline.

import { createInterface } from 'node:readline';
import * as Y from 'yjs';
import { Awareness } from 'y-protocols/awareness';
import { YjsProvider } from '@durable-streams/y-durable-streams';
import { YjsServer } from '@durable-streams/y-durable-streams/server';

const [picomqUrl, service] = process.argv.slice(2);
const WAIT_MS = 10_000;
const SNAPSHOT_THRESHOLD_BYTES = 256; // a few edits' worth: compaction comes quickly
const MAX_EDITS_PER_SNAPSHOT = 100;
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
const problems = []; // every provider error, named, for the message of a failed wait

console.log = console.error; // the YjsServer's compaction notes must not reach stdout

for (const event of ['unhandledRejection', 'uncaughtException']) {
  process.on(event, (error) => {
    console.error(`${event}: ${error?.stack ?? error} ${error?.cause?.code ?? ''}`);
    process.exit(1);
  });
}

function check(condition, text) {
  if (!condition) throw new Error(text);
}

async function until(condition, what) {
  const deadline = Date.now() + WAIT_MS;
  while (!condition()) {
    check(Date.now() < deadline, `timed out waiting for ${what}; errors: ${problems.join(' | ')}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

async function startYjsServer(compactionThreshold) {
  const server = new YjsServer({
    dsServerUrl: picomqUrl, host: '127.0.0.1', port: 0, compactionThreshold,
  });
  await server.start();
  return server;
}

// A named client of document `docId` through `yjsServer`, synced (or the error that kept
// it from syncing: a document that cannot be loaded fails here).
async function join(name, yjsServer, docId, liveMode = 'sse') {
  const doc = new Y.Doc();
  const awareness = new Awareness(doc);
  const client = { name, doc, awareness, errors: [] };
  client.provider = new YjsProvider({
    doc, awareness, liveMode, docId, baseUrl: `${yjsServer.url}/v1/yjs/${service}`,
  });
  client.provider.on('error', (error) => {
    client.errors.push(error);
    problems.push(`${name}: ${error?.message ?? error}`);
  });
  await until(() => client.provider.synced || client.errors.length > 0, `${name} to sync`);
  check(client.errors.length === 0, `${name} could not load ${docId}: ${client.errors[0]?.stack}`);
  return client;
}

const items = (client) => client.doc.getArray('items').toJSON();

function edit(client, ...labels) {
  client.doc.getArray('items').push(labels);
}

// Every client holds the same items, `count` of them.
async function converge(clients, count, what) {
  const same = () => {
    const first = JSON.stringify(items(clients[0]));
    return items(clients[0]).length === count
      && clients.every((client) => JSON.stringify(items(client)) === first);
  };
  const holdings = () => clients.map((c) => `${c.name} ${JSON.stringify(items(c))}`).join(', ');
  await until(same, `${what}: ${holdings()}`);
}

// `speaker`'s presence reaches `listener`. Presence is ephemeral: a state sent while the
// listener's live read reconnects is lost (the provider repeats it every 15 s), so this
// repeats it every 200 ms until it arrives.
async function announce(speaker, listener, state) {
  const seen = () => JSON.stringify(listener.awareness.getStates().get(speaker.doc.clientID))
    === JSON.stringify(state);
  const deadline = Date.now() + WAIT_MS;
  while (!seen()) {
    check(Date.now() < deadline, `${listener.name} never saw ${speaker.name}'s presence`);
    speaker.awareness.setLocalState(state);
    await new Promise((resolve) => setTimeout(resolve, 200));
  }
}

async function picomqTail(docId) {
  const url = `${picomqUrl}/v1/stream/yjs/${service}/docs/${docId}/.updates`;
  const response = await fetch(url, { method: 'HEAD' });
  check(response.ok, `HEAD of ${docId}'s updates: ${response.status}`);
  return response.headers.get('stream-next-offset');
}

// Edit one item at a time, each flushed, until `yjsServer` has compacted the document
// into a snapshot newer than `previous`; return the snapshot's offset.
async function editUntilSnapshot(client, yjsServer, docId, previous) {
  for (let n = 1; n <= MAX_EDITS_PER_SNAPSHOT; n += 1) {
    edit(client, `${client.name}-${items(client).length + 1}`);
    await client.provider.flush();
    // The YjsServer starts a compaction right after answering the append that crossed
    // its threshold, before this process reads that answer: `compacting` is set by now.
    const state = () => yjsServer.getDocumentState(service, docId);
    if (state()?.compacting) await until(() => !state().compacting, 'the compaction to end');
    const offset = state()?.snapshotOffset ?? null;
    if (offset !== previous) return offset;
  }
  throw new Error(`no snapshot after ${MAX_EDITS_PER_SNAPSHOT} edits: ${problems.join(' | ')}`);
}

async function restartPicomq() {
  process.stdout.write('RESTART\n');
  const answer = await lines.next();
  check(answer.value === 'RESTARTED', `test answered ${JSON.stringify(answer)}`);
}

// Two docs, presence, a restart of PicoMQ, a late joiner: no snapshot is ever taken.
async function collaborate(yjsServer) {
  const alice = await join('alice', yjsServer, 'notes', 'sse');
  const bob = await join('bob', yjsServer, 'notes', 'long-poll');
  edit(alice, 'alice-1', 'alice-2');
  edit(bob, 'bob-1', 'bob-2'); // neither has seen the other's edits yet
  await converge([alice, bob], 4, 'concurrent edits to converge');
  await announce(alice, bob, { name: 'alice' });
  await announce(bob, alice, { name: 'bob' });

  await Promise.all([alice.provider.flush(), bob.provider.flush()]);
  await restartPicomq();
  edit(alice, 'alice-3');
  edit(bob, 'bob-3');
  await converge([alice, bob], 6, 'edits after the restart to converge');
  await announce(alice, bob, { name: 'alice', typing: true });

  const carol = await join('carol', yjsServer, 'notes');
  await converge([alice, bob, carol], 6, 'the late joiner to load the document');
  return [alice, bob, carol];
}

// Snapshots: a new client loads one with updates after it, then one at the tail.
async function loadSnapshots() {
  const compacting = await startYjsServer(SNAPSHOT_THRESHOLD_BYTES);
  const dave = await join('dave', compacting, 'compacted');
  const first = await editUntilSnapshot(dave, compacting, 'compacted', null);
  edit(dave, 'dave-after-snapshot-1');
  edit(dave, 'dave-after-snapshot-2');
  await dave.provider.flush();
  check(first < await picomqTail('compacted'), 'no updates after the first snapshot');
  const erin = await join('erin', compacting, 'compacted');
  await converge([dave, erin], items(dave).length, 'a new client to load snapshot + updates');

  // The compactor reads the updates after the first snapshot from its offset plus one.
  const second = await editUntilSnapshot(dave, compacting, 'compacted', first);
  check(second === await picomqTail('compacted'), `second snapshot ${second} is not at the tail`);
  const fresh = await startYjsServer(SNAPSHOT_THRESHOLD_BYTES); // finds it in the index stream
  const frank = await join('frank', fresh, 'compacted');
  const count = items(dave).length;
  await converge([dave, erin, frank], count, 'a new client to load the snapshot at the tail');
  return { servers: [compacting, fresh], clients: [dave, erin, frank], snapshots: [first, second] };
}

const yjsServer = await startYjsServer(undefined); // the package's default: 1 MiB
const together = await collaborate(yjsServer);
const compacted = await loadSnapshots();
for (const client of [...together, ...compacted.clients]) client.provider.destroy();
for (const server of [yjsServer, ...compacted.servers]) await server.stop();
process.stdout.write(
  `OK ${items(together[0]).length} items converged through a restart; `
  + `snapshots at ${compacted.snapshots.join(' and ')} loaded by new clients\n`,
);
process.exit(0);
