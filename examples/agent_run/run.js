// Follows one agent run's stream with long-poll. The run id lives in the URL's hash, so
// a reload reads the stream again from the start (offset -1) and rebuilds the view; each
// event is applied once, by its id, however often it is seen.

const $ = (selector) => document.querySelector(selector);
const seen = new Set();
const config = await (await fetch('/config.json')).json();

async function follow(runId) {
  $('#run').textContent = `run ${runId}`;
  const url = `${config.picomqUrl}/v1/stream/agents/${runId}`;
  let offset = '-1';
  for (;;) {
    let response;
    try {
      response = await fetch(`${url}?offset=${offset}&live=long-poll`, { cache: 'no-store' });
    } catch {
      $('#state').textContent = 'Connection lost; retrying…';
      await new Promise((resolve) => setTimeout(resolve, 1000));
      continue;
    }
    if (!response.ok && response.status !== 204) {
      $('#state').textContent = `Cannot read the run: ${response.status}`;
      return;
    }
    if (response.status === 200) for (const event of await response.json()) apply(event);
    offset = response.headers.get('Stream-Next-Offset') ?? offset;
    if (response.headers.get('Stream-Closed') === 'true') return;
  }
}

function apply(event) {
  if (seen.has(event.id)) return;
  seen.add(event.id);
  const item = document.createElement('li');
  item.dataset.id = event.id;
  item.className = event.type;
  item.textContent = `${event.type}: ${event.message}`;
  $('#events').append(item);
  $('#progress').value = event.step / event.total;
  $('#state').textContent = event.type === 'finished' ? 'Done.' : `Step ${event.step} of ${event.total}…`;
}

$('#start').addEventListener('click', async () => {
  const run = await (await fetch('/runs', { method: 'POST' })).json();
  location.hash = `run=${run.run}`;
  location.reload(); // one way in: the same code path as a reload
});

const runId = new URLSearchParams(location.hash.slice(1)).get('run');
if (runId) follow(runId);
