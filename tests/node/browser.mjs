// Debian's headless Chromium for the page drivers (agent_run.mjs, inspector.mjs).

import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { chromium } from 'playwright-core';

const CHROMIUM_ARGS = [
  '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync',
];

// Opens a page in a fresh Chromium profile, runs check(page, problems) (problems collects
// the page's uncaught errors), and exits: 0 if check returned, 1 with the error on stderr
// and a screenshot at screenshotPath if it threw.
export async function runInBrowser(screenshotPath, check) {
  const userDataDir = mkdtempSync(join(tmpdir(), 'picomq-chromium-'));
  const context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: '/usr/bin/chromium',
    headless: true,
    args: CHROMIUM_ARGS,
  });
  const page = context.pages()[0] ?? await context.newPage();
  const problems = [];
  page.on('pageerror', (error) => problems.push(`page error: ${error.message}`));
  let status = 0;
  try {
    await check(page, problems);
  } catch (error) {
    status = 1;
    console.error(error.stack || String(error));
    await page.screenshot({ path: screenshotPath, fullPage: true }).catch(() => {});
  } finally {
    await context.close();
    rmSync(userDataDir, { recursive: true, force: true });
  }
  process.exit(status);
}
