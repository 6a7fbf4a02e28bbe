// BullMQ beside drumline (docs/performance.md#peers-bullmq-and-celery): the same Redis, the same
// dedupe as the Celery peer (SET NX of the job's key before it runs), one Worker (in this Node
// process) at concurrency c. BullMQ keeps its queues in Redis, so there is no broker in its path.
//
// --mode drain: pre-fills a queue with N jobs (`addBulk`), starts the Worker and times from its
//   start until N jobs have completed (acknowledged in Redis; counted by the Worker's
//   'completed' events, which cost no round trip), and from the first completed job on.
// --mode scheduler: a Worker waits, then N job schedulers are made (`upsertJobScheduler`, every
//   hour from the same second T a few seconds ahead, as drumline's bench_publish makes N
//   `every` jobs; --cron: a cron pattern matching T once a day). Timed from T:
//   until none of the N jobs is left in the delayed set (all in the wait list or further: "ready",
//   what drumline's bench_publish times to its queue), and until the Worker has started all N
//   (the figure we compare: only then has BullMQ done what drumline's beat has done once its
//   messages are queued, i.e. also recorded each schedule's next instance, which BullMQ does as a
//   worker takes the job; and only a worker promotes due jobs at all, there is no beat).
//
// Each figure is --runs runs, median (min–max). --beside FILE reads drumline's figures of the
// same `scripts/bench` run (throughput's --json-file for drain, bench_publish's for scheduler)
// and prints drumline / BullMQ. --json prints one JSON line; --json-file PATH writes it there.
// Everything is under its own key prefix and deleted at the end. Asserts nothing about speed.
//
//   node scripts/peer_bullmq.mjs --mode drain --messages 50000 --concurrency 32 --runs 3
//
// bullmq comes from the npm registry into ${CARGO_TARGET_DIR:-target}/peernode (`ensure_bullmq`
// in scripts/services); --modules names that directory.
import { createRequire } from 'node:module';
import { join, resolve } from 'node:path';
import { readFileSync, writeFileSync } from 'node:fs';
import { parseArgs } from 'node:util';

const REDIS = { host: '127.0.0.1', port: 6379, maxRetriesPerRequest: null };
const PREFIX = process.env.PEER_NS ?? `bench_bullmq_${process.pid}`;
// Time to make 10,000 schedulers on a busy two-core machine, with room to spare.
const LEAD_MS = 12_000;

const { values: args } = parseArgs({
  options: {
    mode: { type: 'string', default: 'drain' },
    messages: { type: 'string', default: '50000' },
    concurrency: { type: 'string', default: '32' },
    runs: { type: 'string', default: '3' },
    timeout: { type: 'string', default: '600' },
    modules: { type: 'string', default: join(process.env.CARGO_TARGET_DIR ?? 'target', 'peernode') },
    beside: { type: 'string' },
    cron: { type: 'boolean', default: false },
    json: { type: 'boolean', default: false },
    'json-file': { type: 'string' },
  },
});
const n = Number(args.messages);
const concurrency = Number(args.concurrency);
const timeoutMs = Number(args.timeout) * 1000;

const require = createRequire(join(resolve(args.modules), 'package.json'));
const { Queue, Worker } = require('bullmq');
const IORedis = require('ioredis');
const version = require('bullmq/package.json').version;
const store = new IORedis(REDIS);

/** Wall-clock milliseconds, sub-millisecond precise (T is a wall-clock instant). */
const wallNow = () => performance.timeOrigin + performance.now();
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** The dedupe (as the Celery peer's): true for the first delivery of the job's key. */
async function firstTime(job) {
  const key = `${PREFIX}:dedupe:${job.queueName}:${job.id}`;
  return (await store.set(key, 1, 'EX', 86400, 'NX')) === 'OK';
}

/** The no-op: the dedupe, then nothing. */
async function noop(job) {
  if (await firstTime(job)) {
    // the task itself does nothing
  }
}

function startWorker(name, processor) {
  return new Worker(name, processor, { connection: REDIS, prefix: PREFIX, concurrency });
}

/** Resolves once `done()` is true, polled every 10 ms; rejects after --timeout seconds. */
async function until(what, done) {
  const deadline = Date.now() + timeoutMs;
  while (!(await done())) {
    if (Date.now() > deadline) throw new Error(`bullmq: timed out waiting for ${what}`);
    await sleep(10);
  }
}

async function fill(queue) {
  for (let i = 0; i < n; i += 1000) {
    const size = Math.min(1000, n - i);
    await queue.addBulk(Array.from({ length: size }, (_, j) => ({ name: 'noop', data: { i: i + j } })));
  }
}

/** One drain: jobs per second from the Worker's start, and from its first completed job. */
async function drainRun(run) {
  const name = `drain${run}`;
  const queue = new Queue(name, { connection: REDIS, prefix: PREFIX });
  await fill(queue);
  let completed = 0;
  let first = null;
  const started = performance.now();
  const worker = startWorker(name, noop);
  worker.on('completed', () => {
    completed += 1;
    if (first === null) first = { at: performance.now(), completed };
  });
  await until(`${n} completed jobs`, () => completed >= n);
  const now = performance.now();
  await Promise.all([worker.close(), queue.close()]);
  const steady = (n - first.completed) / Math.max(now - first.at, 1e-3);
  return { whole: (n / (now - started)) * 1000, steady: steady * 1000 };
}

/** How each scheduler repeats, its first instance at `due`: as drumline's bench_publish jobs
 * (`every` with an anchor), once an hour from `due`; with --cron, a cron pattern that matches
 * `due`'s second once a day (BullMQ computes its next instance with cron-parser, in the worker). */
function repeatFrom(due) {
  if (!args.cron) return { every: 3_600_000, startDate: due };
  const at = new Date(due);
  return { pattern: `${at.getUTCSeconds()} ${at.getUTCMinutes()} ${at.getUTCHours()} * * *`, tz: 'UTC' };
}

/** N schedulers whose first job falls due at `due` (a whole second). */
async function makeSchedulers(queue, due) {
  const repeat = repeatFrom(due);
  for (let i = 0; i < n; i += 1000) {
    const ids = Array.from({ length: Math.min(1000, n - i) }, (_, j) => `s${i + j}`);
    await Promise.all(ids.map((id) => queue.upsertJobScheduler(id, repeat, { name: 'noop', data: {} })));
  }
}

/** How many of the jobs due at `due` are still delayed (BullMQ scores: ms * 0x1000 + counter). */
function stillDelayed(name, due) {
  return store.zcount(`${PREFIX}:${name}:delayed`, 0, (due + 1) * 0x1000 - 1);
}

/** One scheduler run: ms from T until the first and all jobs are ready, and until all started. */
async function schedulerRun(run) {
  const name = `sched${run}`;
  const queue = new Queue(name, { connection: REDIS, prefix: PREFIX });
  let started = 0;
  let allStarted = null;
  const worker = startWorker(name, async (job) => {
    await noop(job);
    started += 1;
    if (started === n) allStarted = wallNow();
  });
  await worker.waitUntilReady();
  const due = Math.ceil((Date.now() + LEAD_MS) / 1000) * 1000;
  await makeSchedulers(queue, due);
  const delayed = await stillDelayed(name, due);
  if (Date.now() > due - 500 || delayed !== n) {
    throw new Error(`bullmq: ${delayed} of ${n} schedulers made ${due - Date.now()} ms before T`);
  }
  let firstReady = null;
  await until('every job due at T to leave the delayed set', async () => {
    const left = await stillDelayed(name, due);
    if (left < n && firstReady === null) firstReady = wallNow();
    return left === 0;
  });
  const allReady = wallNow();
  await until(`the worker to start ${n} jobs`, () => allStarted !== null);
  await Promise.all([worker.close(), queue.close()]);
  return { first: firstReady - due, ready: allReady - due, started: allStarted - due };
}

async function clean() {
  let cursor = '0';
  do {
    const [next, keys] = await store.scan(cursor, 'MATCH', `${PREFIX}:*`, 'COUNT', 10000);
    if (keys.length) await store.unlink(...keys);
    cursor = next;
  } while (cursor !== '0');
}

/** {median, min, max, runs} of numbers, rounded as `digits`. */
function figure(xs, digits = 0) {
  const sorted = [...xs].sort((a, b) => a - b);
  const r = (x) => Number(x.toFixed(digits));
  return { median: r(sorted[sorted.length >> 1]), min: r(sorted[0]), max: r(sorted.at(-1)), runs: xs.map(r) };
}

const int = (x) => Math.round(x).toLocaleString('en');
/** "median (min–max)" in whole numbers. */
const spread = (f) => `${int(f.median)} (${int(f.min)}–${int(f.max)})`;

/** drumline's figure of the same run from the JSON file its bench step wrote, or null. */
function drumlineFigure() {
  if (!args.beside) return null;
  const report = JSON.parse(readFileSync(args.beside, 'utf8'));
  if (args.mode === 'scheduler') return report.beats[0].all_queued_ms;
  const row = report.throughput.find((r) => r.mode === 'drain' && r.concurrency === concurrency);
  return row ? row.worker_msgs_per_s : null;
}

function reportDrain(runs, drumline) {
  const whole = figure(runs.map((r) => r.whole));
  const steady = figure(runs.map((r) => r.steady));
  const ratio = drumline && drumline.median / whole.median;
  const report = { jobs_per_s: whole, steady_jobs_per_s: steady, drumline_msgs_per_s: drumline, drumline_over_bullmq: ratio };
  if (args.json) return report;
  console.log(`bullmq ${version} drain c=${concurrency} ${n} no-op jobs: ${spread(whole)} jobs/s from the worker's start, ${spread(steady)} from its first job`);
  if (drumline) console.log(`  drumline worker c=${concurrency}, same run: ${spread(drumline)} msg/s; drumline / BullMQ ${ratio.toFixed(2)}`);
  return report;
}

function reportScheduler(runs, drumline) {
  const [first, ready, started] = ['first', 'ready', 'started'].map((k) => figure(runs.map((r) => r[k])));
  const ratio = drumline && started.median / drumline.median;
  const report = { first_ready_ms: first, all_ready_ms: ready, all_started_ms: started, drumline_all_queued_ms: drumline, bullmq_started_over_drumline: ratio };
  if (args.json) return report;
  console.log(`bullmq ${version} ${n} job schedulers (${args.cron ? 'cron' : 'every'}) due at T (worker c=${concurrency}), ms from T: first ready ${spread(first)}, all ready ${spread(ready)}, all started ${spread(started)}`);
  if (drumline) {
    console.log(`  drumline beat, same run, T -> all ${n} queued: ${spread(drumline)} ms; BullMQ all started / drumline ${ratio.toFixed(2)}, all ready / drumline ${(ready.median / drumline.median).toFixed(2)}`);
  }
  return report;
}

async function main() {
  const one = args.mode === 'scheduler' ? schedulerRun : drainRun;
  const runs = [];
  try {
    await clean();
    for (let run = 0; run < Number(args.runs); run++) runs.push(await one(run));
  } finally {
    await clean();
  }
  const report = (args.mode === 'scheduler' ? reportScheduler : reportDrain)(runs, drumlineFigure());
  const line = JSON.stringify({ peer: 'bullmq', version, mode: args.mode, cron: args.cron, concurrency, jobs: n, ...report });
  if (args.json) console.log(line);
  if (args['json-file']) writeFileSync(args['json-file'], line);
  await store.quit();
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
