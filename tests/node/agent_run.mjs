// Drives examples/agent_run in Debian's headless Chromium for tests/test_examples.py:
//
//   node agent_run.mjs BACKEND_URL SCREENSHOT_PATH
//
// Starts a run from the page, reloads the page while the run is going, and checks the
// rebuilt view ends with every event once, in order: started, each step, finished.

import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { chromium } from 'playwright-core';

const [backendUrl, screenshotPath] = process.argv.slice(2);
const WAIT_MS = 30_000;
const CHROMIUM_ARGS = [
  '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync',
];

const userDataDir = mkdtempSync(join(tmpdir(), 'picomq-chromium-'));
const context = await chromium.launchPersistentContext(userDataDir, {
  executablePath: '/usr/bin/chromium', headless: true, args: CHROMIUM_ARGS,
});
const page = context.pages()[0] ?? await context.newPage();
const problems = [];
page.on('pageerror', (error) => problems.push(`page error: ${error.message}`));
let status = 0;
try {
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
} catch (error) {
  status = 1;
  console.error(error.stack || String(error));
  await page.screenshot({ path: screenshotPath, fullPage: true }).catch(() => {});
} finally {
  await context.close();
  rmSync(userDataDir, { recursive: true, force: true });
}
process.exit(status);
