// Drives examples/agent_run in Debian's headless Chromium for tests/test_examples.py:
//
//   node agent_run.mjs BACKEND_URL SCREENSHOT_PATH
//
// Starts a run from the page, reloads the page while the run is going, and checks the
// rebuilt view ends with every event once, in order: started, each step, finished.

import { runInBrowser } from './browser.mjs';

const [backendUrl, screenshotPath] = process.argv.slice(2);
const WAIT_MS = 30_000;

await runInBrowser(screenshotPath, async (page, problems) => {
  await page.goto(`${backendUrl}/`);
  await page.click('#start');
  await page.locator('#events li.progress').nth(1).waitFor({ timeout: WAIT_MS });
  await page.reload(); // mid-run: the view must come back whole, the run must go on
  await page.locator('#events li.finished').waitFor({ timeout: WAIT_MS });
  const types = await page.locator('#events li').evaluateAll(
    (items) => items.map((item) => `${item.className}:${item.dataset.id}`));
  const run = new URL(page.url()).hash.replace('#run=', '');
  const steps = types.length - 2;
  const expected = [
    `started:${run}:0`,
    ...Array.from({ length: steps }, (_, i) => `progress:${run}:${i + 1}`),
    `finished:${run}:${steps + 1}`,
  ];
  if (steps < 2 || JSON.stringify(types) !== JSON.stringify(expected)) {
    throw new Error(`page shows ${JSON.stringify(types)}`);
  }
  if (problems.length) throw new Error(problems.join('; '));
  console.log(`OK ${run} ${steps}`);
});
