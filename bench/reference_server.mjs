// The Durable Streams reference server (@durable-streams/server, pinned in package.json)
// with its file-backed store, for bench/compare.py.
//
//   node reference_server.mjs <port> <data-dir> [long-poll-timeout-ms]
//
// Listens on 127.0.0.1 only. Compression is off so that both servers send identity
// bodies (the bench's clients never ask for gzip anyway). Stops on SIGTERM or SIGINT.
import { DurableStreamTestServer } from "@durable-streams/server"

const [port, dataDir, longPollTimeout = "20000"] = process.argv.slice(2)
if (!port || !dataDir) {
  console.error("usage: node reference_server.mjs <port> <data-dir> [long-poll-timeout-ms]")
  process.exit(2)
}

const server = new DurableStreamTestServer({
  host: "127.0.0.1",
  port: Number(port),
  dataDir,
  longPollTimeout: Number(longPollTimeout),
  compression: false,
})
const url = await server.start()
console.log(`reference server listening on ${url}, data in ${dataDir}`)

let stopping = false
async function stop() {
  if (stopping) return
  stopping = true
  await server.stop()
  process.exit(0)
}
process.on("SIGTERM", stop)
process.on("SIGINT", stop)
