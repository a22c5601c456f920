// PicoMQ inspector: list streams, open one, see its history and follow it live over
// SSE; after any disconnect, resume from the last offset with no gap and no duplicate.
//
// SSE is read with fetch (not EventSource) so a token travels in the Authorization
// header: it is kept in this page's memory only, never in a URL, storage or history.
// A data event is shown only together with the control event that follows it (the
// one carrying its end offset), so what is on screen always matches the offset
// shown, and resuming from that offset can neither skip nor repeat a message.

const RETRY_DELAYS_MS = [500, 1000, 2000, 4000, 5000];
const PAGE_SIZE = 50;
const MAX_SHOWN_MESSAGES = 2000;

const $ = (selector) => document.querySelector(selector);
let token = null;
let follower = null;
let nextAfter = null;

class HttpError extends Error {
  constructor(status, message) {
    super(`${message} (${status})`);
    this.status = status;
  }
}

async function request(url, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (token) headers.Authorization = `Bearer ${token}`;
  const response = await fetch(url, { ...options, headers, cache: 'no-store' });
  if (!response.ok) {
    let message = response.statusText;
    try {
      message = (await response.json()).error.message;
    } catch {
      // no JSON error body (HEAD, or a proxy's page): the status text says enough
    }
    throw new HttpError(response.status, message);
  }
  return response;
}

function streamUrl(path, params = {}) {
  const encoded = path.split('/').map(encodeURIComponent).join('/');
  const query = new URLSearchParams(params).toString();
  return `/v1/stream/${encoded}${query ? `?${query}` : ''}`;
}

function sleep(milliseconds, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, milliseconds);
    signal.addEventListener('abort', () => { clearTimeout(timer); resolve(); }, { once: true });
  });
}

function describe(error) {
  if (error instanceof HttpError && (error.status === 401 || error.status === 403)) {
    return `access denied: ${error.message}; enter a token above`;
  }
  return error.message;
}

// -- the stream list -------------------------------------------------------------------

async function listStreams({ more = false } = {}) {
  const params = { prefix: $('#prefix').value, limit: String(PAGE_SIZE) };
  if (more && nextAfter) params.after = nextAfter;
  const body = $('#streams tbody');
  try {
    const page = await (await request(`/v1/streams?${new URLSearchParams(params)}`)).json();
    if (!more) body.replaceChildren();
    for (const stream of page.streams) body.append(streamRow(stream));
    nextAfter = page.next;
    $('#more').hidden = !page.next;
    $('#list-status').textContent = `${body.rows.length} stream(s)${page.next ? ' so far' : ''}`;
  } catch (error) {
    $('#list-status').textContent = describe(error);
  }
}

function streamRow(stream) {
  const row = document.createElement('tr');
  row.dataset.path = stream.path;
  for (const text of [stream.path, stream.bytes, stream.contentType, stream.closed ? 'yes' : 'no']) {
    const cell = document.createElement('td');
    cell.textContent = String(text);
    row.append(cell);
  }
  row.addEventListener('click', () => openStream(stream.path));
  return row;
}

// -- one stream, followed live ------------------------------------------------------------

function openStream(path) {
  if (follower) follower.stop();
  for (const row of document.querySelectorAll('#streams tr.open')) row.classList.remove('open');
  document.querySelector(`#streams tr[data-path="${CSS.escape(path)}"]`)?.classList.add('open');
  history.replaceState(null, '', `#stream=${encodeURIComponent(path)}`);
  $('#viewer').hidden = false;
  $('#stream-path').textContent = path;
  $('#messages').replaceChildren();
  $('#log').replaceChildren();
  follower = new Follower(path);
  follower.run();
}

class Follower {
  constructor(path) {
    this.path = path;
    this.offset = '-1';
    this.controller = new AbortController();
    this.isJson = false;
  }

  stop() {
    this.controller.abort();
  }

  get stopped() {
    return this.controller.signal.aborted;
  }

  async run() {
    try {
      const head = await request(streamUrl(this.path), { method: 'HEAD', signal: this.controller.signal });
      const contentType = head.headers.get('Content-Type') || '';
      this.isJson = contentType.split(';')[0].trim().toLowerCase() === 'application/json';
      $('#content-type').textContent = contentType;
      this.showOffset(this.offset);
      await this.follow();
    } catch (error) {
      if (!this.stopped) this.status('stopped', describe(error));
    }
  }

  async follow() {
    let failures = 0;
    let lost = false;
    while (!this.stopped) {
      try {
        const params = { offset: this.offset, live: 'sse' };
        const response = await request(streamUrl(this.path, params), { signal: this.controller.signal });
        if (lost) {
          this.log(`resumed from offset ${this.offset}`);
          this.status('live', `live, resumed from offset ${this.offset} after a disconnect`);
          lost = false;
        } else if (failures === 0) {
          this.status('live', 'live');
        }
        failures = 0;
        const base64 = response.headers.get('Stream-SSE-Data-Encoding') === 'base64';
        if (await this.readEvents(response.body, base64)) {
          this.status('stopped', 'closed: the stream has ended');
          return;
        }
        // The server ends each SSE response after a while: reconnect from the offset.
      } catch (error) {
        if (this.stopped) return;
        if (error instanceof HttpError && error.status < 500) throw error;
        const delay = RETRY_DELAYS_MS[Math.min(failures, RETRY_DELAYS_MS.length - 1)];
        failures += 1;
        if (!lost) this.log(`connection lost at offset ${this.offset}`);
        lost = true;
        this.status('retrying', `disconnected; retrying in ${delay / 1000} s from offset ${this.offset}`);
        await sleep(delay, this.controller.signal);
      }
    }
  }

  // Returns true when the stream is closed and fully read; false when the response ended.
  async readEvents(body, base64) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    let pendingData = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return false;
      buffer += value;
      let end;
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        const event = parseEvent(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
        if (event.type === 'data') {
          pendingData = event.data;
        } else if (event.type === 'control') {
          const control = JSON.parse(event.data);
          if (pendingData !== null) this.show(pendingData, base64);
          pendingData = null;
          this.showOffset(control.streamNextOffset);
          if (control.streamClosed) return true;
        }
      }
    }
  }

  show(data, base64) {
    const list = $('#messages');
    let items;
    if (base64) {
      const bytes = Uint8Array.from(atob(data.replace(/\n/g, '')), (c) => c.charCodeAt(0));
      const hex = Array.from(bytes.slice(0, 64), (b) => b.toString(16).padStart(2, '0')).join(' ');
      items = [`${bytes.length} bytes: ${hex}${bytes.length > 64 ? ' …' : ''}`];
    } else if (this.isJson) {
      items = JSON.parse(data).map((message) => JSON.stringify(message));
    } else {
      items = [data];
    }
    for (const text of items) {
      const item = document.createElement('li');
      item.textContent = text;
      list.append(item);
    }
    while (list.children.length > MAX_SHOWN_MESSAGES) list.firstElementChild.remove();
  }

  showOffset(offset) {
    this.offset = offset;
    $('#offset').textContent = offset;
  }

  status(kind, text) {
    if (this.stopped) return;
    $('#status').className = kind;
    $('#status').textContent = text;
  }

  log(text) {
    const item = document.createElement('li');
    item.textContent = `${new Date().toLocaleTimeString()} ${text}`;
    $('#log').append(item);
  }
}

// One SSE event block: its type and its data lines joined by newlines.
function parseEvent(block) {
  let type = 'message';
  const data = [];
  for (const line of block.split('\n')) {
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? '' : line.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'event') type = value;
    else if (field === 'data') data.push(value);
  }
  return { type, data: data.join('\n') };
}

// -- wiring ---------------------------------------------------------------------------------

$('#list-form').addEventListener('submit', (event) => {
  event.preventDefault();
  listStreams();
});
$('#more').addEventListener('click', () => listStreams({ more: true }));
$('#token-form').addEventListener('submit', (event) => {
  event.preventDefault();
  token = $('#token').value.trim() || null;
  $('#token-state').textContent = token ? 'token in use (kept in this page only)' : 'no token';
  listStreams();
  if (follower) openStream(follower.path);
});

const opened = new URLSearchParams(location.hash.slice(1)).get('stream');
listStreams();
if (opened) openStream(opened);
