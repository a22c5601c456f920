// Drives the web inspector in Debian's headless Chromium for tests/test_inspector.py.
//
//   node inspector.mjs BASE_URL STREAM_PATH SCREENSHOT_PATH [TOKEN]
//
// Opens the page, lists and opens the stream (which holds {"n":1} and {"n":2}),
// appends {"n":3} and sees it, then prints "RESTART" and waits for the test to restart
// the server and answer "RESTARTED" on stdin; then appends {"n":4} and {"n":5} and
// checks the page shows exactly 1..5, once each, and says it resumed. Exits non-zero
// with the reason on stderr on any failure. Every wait has a deadline. With a TOKEN
// (access control on), the page must first say access is denied, take the token in its
// Token field, and never show the token in its URL or its markup.

import { createInterface } from 'node:readline';
import { runInBrowser } from './browser.mjs';

const [baseUrl, streamPath, screenshotPath, token] = process.argv.slice(2);
const authorization = token ? { Authorization: `Bearer ${token}` } : {};
const WAIT_MS = 20_000;
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();

async function append(n) {
  const url = `${baseUrl}/v1/stream/${streamPath}`;
  const response = await fetch(url, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', ...authorization },
    body: JSON.stringify({ n }),
  });
  if (response.status !== 204) throw new Error(`append ${n}: ${response.status}`);
}

const expected = (count) => Array.from({ length: count }, (_, i) => JSON.stringify({ n: i + 1 }));

async function expectMessages(page, count) {
  const items = page.locator('#messages li');
  await items.nth(count - 1).waitFor({ timeout: WAIT_MS });
  const shown = await items.allTextContents();
  if (JSON.stringify(shown) !== JSON.stringify(expected(count))) {
    throw new Error(`page shows ${JSON.stringify(shown)}, expected 1..${count} once each`);
  }
}

async function expectText(page, selector, fragment, state = 'visible') {
  const match = page.locator(selector, { hasText: fragment }).first();
  await match.waitFor({ timeout: WAIT_MS, state });
}

await runInBrowser(screenshotPath, async (page, problems) => {
  await page.goto(`${baseUrl}/`);
  if (token) {
    await expectText(page, '#list-status', 'access denied');
    await page.fill('#token', token);
    await page.click('#token-form button');
    await expectText(page, '#token-state', 'token in use');
  }
  await page.fill('#prefix', streamPath);
  await page.click('#list-form button');
  await page.click(`#streams tr[data-path="${streamPath}"]`, { timeout: WAIT_MS });
  await expectMessages(page, 2); // the history
  await expectText(page, '#status', 'live');

  await append(3);
  await expectMessages(page, 3); // live
  const offsetBefore = await page.textContent('#offset');

  console.log('RESTART');
  const answer = await lines.next();
  if (answer.value !== 'RESTARTED') throw new Error(`test answered ${JSON.stringify(answer)}`);
  // The log sits in a closed <details>: present, not visible.
  await expectText(page, '#log li', `connection lost at offset ${offsetBefore}`, 'attached');
  await expectText(page, '#status', `resumed from offset ${offsetBefore}`);

  await append(4);
  await append(5);
  await expectMessages(page, 5);
  const offsetAfter = await page.textContent('#offset');
  const tail = (await fetch(`${baseUrl}/v1/stream/${streamPath}`, {
    method: 'HEAD', headers: authorization,
  })).headers.get('Stream-Next-Offset');
  if (offsetAfter !== tail) throw new Error(`page shows offset ${offsetAfter}, tail is ${tail}`);
  if (token && (page.url().includes(token) || (await page.content()).includes(token))) {
    throw new Error('the token shows in the page URL or markup');
  }
  if (problems.length) throw new Error(problems.join('; '));
});
