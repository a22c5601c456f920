// Opens what anyone who may create a stream can write, in Debian's headless Chromium,
// for tests/test_inspector.py:
//
//   node sandbox.mjs BASE_URL PAGE_STREAM SCRIPT_STREAM SCREENSHOT_PATH
//
// PAGE_STREAM (text/html) holds a script that sets the page's title to "ran": opened as
// a page, it must not run. SCRIPT_STREAM (text/javascript) sets window.ran: added to the
// inspector's page as a <script src>, it must not run either, while the inspector's own
// script and stylesheet load without a Content-Security-Policy complaint. Exits non-zero
// with the reason on stderr on any failure; every wait has a deadline.

import { runInBrowser } from './browser.mjs';

const [baseUrl, pageStream, scriptStream, screenshotPath] = process.argv.slice(2);
const WAIT_MS = 10_000;

await runInBrowser(screenshotPath, async (page, problems) => {
  const complaints = [];
  page.on('console', (message) => {
    if (message.text().includes('Content Security Policy')) complaints.push(message.text());
  });
  await page.goto(`${baseUrl}/`);
  await page.locator('#list-status').waitFor({ timeout: WAIT_MS, state: 'attached' });
  await page.waitForFunction(() => document.styleSheets.length > 0, null, { timeout: WAIT_MS });
  if (complaints.length) throw new Error(`the inspector's own page: ${complaints.join('; ')}`);

  const outcome = await page.evaluate(async ([src, waitMs]) => {
    const script = document.createElement('script');
    const settled = new Promise((resolve) => {
      script.onload = () => resolve('loaded');
      script.onerror = () => resolve('refused');
      setTimeout(() => resolve('no answer'), waitMs);
    });
    script.src = src;
    document.head.append(script);
    return { settled: await settled, ran: window.ran === true };
  }, [`/v1/stream/${scriptStream}`, WAIT_MS]);
  if (outcome.ran || outcome.settled !== 'refused') {
    throw new Error(`a stream as the inspector's script: ${JSON.stringify(outcome)}`);
  }

  await page.goto(`${baseUrl}/v1/stream/${pageStream}`);
  const title = await page.title();
  if (title === 'ran') throw new Error('a text/html stream ran its script as a page');
  if (problems.length) throw new Error(problems.join('; '));
  console.log('OK stream bodies ran nowhere');
});
