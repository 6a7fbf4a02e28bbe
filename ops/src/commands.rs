//! The bodies of `drumline-beat`'s commands: each takes a loaded config, prints its output and
//! returns `Ok` or a [`Failure`] that carries the exit code. `main.rs` only parses and dispatches.

use crate::{adhoc, next, operate, page, status};
use chrono::{DateTime, Utc};
use drumline_beat::scheduler;
use drumline_shared::broker::BrokerError;
use drumline_shared::client::ClientError;
use drumline_shared::config::{Config, Job, Overlap};
use drumline_shared::exit::Failure;
use drumline_shared::names::Names;
use drumline_shared::store::{Store, StoreError};
use serde::Serialize;
use std::net::SocketAddr;
use std::path::Path;

/// The command-line flags of a running beat: those of `drumline beat` and of `drumline-beat`.
#[derive(clap::Args, Debug, Default)]
pub struct Options {
    /// Serve Prometheus metrics at /metrics, a health check at /healthz and the status page at
    /// / (JSON: /api/status) on HOST:PORT.
    #[arg(long, value_parser = drumline_shared::metrics::parse_addr)]
    pub metrics_addr: Option<SocketAddr>,
    /// Serve the HTTP API (schedules at run time; docs/api.md) on HOST:PORT; every request
    /// needs the bearer token in the variable `[api] token_env` names (default
    /// DRUMLINE_API_TOKEN). Overrides `[api] addr`.
    #[arg(long, value_parser = drumline_shared::metrics::parse_addr)]
    pub api_addr: Option<SocketAddr>,
}

/// No command: run the beat until SIGTERM or SIGINT, serving metrics, health and the status
/// page on `--metrics-addr` and the API on `--api-addr`.
pub async fn run(config: Config, options: Options) -> Result<(), Failure> {
    let stats = scheduler::BeatStats::default();
    // One config for the beat, the status page and the API (a clone would copy every job).
    let config = std::sync::Arc::new(config);
    crate::api::serve(&config, options.api_addr, store(&config)).await?;
    if let Some(addr) = options.metrics_addr {
        let mut registry = prometheus_client::registry::Registry::default();
        stats.register(&mut registry);
        drumline_shared::process_metrics::register(&mut registry, "beat", &config.namespace);
        let queues = crate::queues::QueueGauges::default();
        queues.register(&mut registry);
        // One broker connection for the page's counts and the queue gauges.
        let counts = std::sync::Arc::new(crate::dead_letters::DeadLetters::new(config.clone()));
        queues.spawn_refresh(counts.clone());
        let health_stats = stats.clone();
        let health = std::sync::Arc::new(move || health_stats.health());
        let page = page::routes(config.clone(), counts);
        drumline_shared::metrics::serve_with(addr, registry, health, page)
            .await
            .map_err(|e| Failure::usage(format!("--metrics-addr {addr}: {e}")))?;
        tracing::info!(%addr, "serving the status page at / and /api/status");
    }
    // Listening before READY=1: a stop from then on is orderly (docs/operations.md#systemd).
    let stopping = drumline_shared::signals::Shutdown::listen().wait("finishing the batch in hand");
    let _watchdog = drumline_shared::systemd::ready();
    match scheduler::run(config, stats, stopping).await {
        Ok(_) => Ok(()),
        // A queue declared with other arguments (say a changed dead_ttl) is a config problem.
        Err(e @ BrokerError::Mismatch { .. }) => Err(Failure::usage(e)),
        Err(e) => Err(Failure::other(e)),
    }
}

/// `check`: the config at `path` loaded; say so.
pub(crate) fn check(path: &Path, config: &Config) -> Result<(), Failure> {
    println!(
        "{}: ok ({} jobs, {} tasks, namespace {:?})",
        path.display(),
        config.jobs.len(),
        config.tasks.len(),
        config.namespace
    );
    Ok(())
}

/// `next`: the next `count` instants of `job` (or of every job) after `from` (default now).
pub(crate) fn show_next(
    config: &Config,
    job: Option<&str>,
    count: usize,
    from: Option<&str>,
    json: bool,
) -> Result<(), Failure> {
    let from: DateTime<Utc> = match from {
        None => Utc::now(),
        Some(text) => DateTime::parse_from_rfc3339(text)
            .map_err(|e| {
                Failure::usage(format!("--from {text:?} is not an RFC 3339 instant ({e})"))
            })?
            .with_timezone(&Utc),
    };
    let jobs: Vec<&Job> = match job {
        Some(name) => vec![find_job(config, name)?],
        None => config.jobs.iter().collect(),
    };
    let lines: Vec<_> = jobs
        .iter()
        .flat_map(|j| next::upcoming(j, from, count, &config.calendars))
        .collect();
    print_output(&lines, json, |l| next::table(l));
    Ok(())
}

/// `publish --args TEXT`, `trigger --args TEXT`: the task's arguments, a JSON object.
pub(crate) fn json_args(text: &str) -> Result<serde_json::Value, Failure> {
    match serde_json::from_str(text) {
        Ok(args @ serde_json::Value::Object(_)) => Ok(args),
        Ok(_) => Err(Failure::usage("--args must be a JSON object ({\"k\": …})")),
        Err(e) => Err(Failure::usage(format!("--args is not JSON: {e}"))),
    }
}

/// `publish`: one ad-hoc task.
pub(crate) async fn publish(config: &Config, request: &adhoc::Request) -> Result<(), Failure> {
    let env =
        adhoc::envelope(config, request, Utc::now()).map_err(|e| Failure::usage(e.for_cli()))?;
    warn_unconsumed(config, &env.queue).await?;
    if request.key.is_some() {
        warn_recorded(config, &env.key).await;
    }
    adhoc::publish(config, &env)
        .await
        .map_err(publish_failure)?;
    println!(
        "published {} key={} queue={} due={}",
        env.task,
        env.key,
        env.queue,
        drumline_shared::envelope::format_instant(env.scheduled_for)
    );
    Ok(())
}

/// `publish`'s first look at the broker: warns on stderr when no worker consumes `queue` (the
/// copy would wait until one does). A broker that cannot be reached fails the command, naming
/// it; any other failure of the look is only told.
pub(crate) async fn warn_unconsumed(config: &Config, queue: &str) -> Result<(), Failure> {
    let names = Names::new(config.namespace.clone());
    let queues = [queue.to_owned()];
    match drumline_shared::broker::queue_counts(config, &names, &queues).await {
        Ok(counts) => {
            if let Some(warning) = unconsumed_warning(queue, counts[0]) {
                eprintln!("{warning}");
            }
            Ok(())
        }
        Err(e @ BrokerError::Unreachable { .. }) => Err(Failure::other(e)),
        Err(e) => {
            eprintln!("warning: cannot count the consumers of queue {queue}: {e}");
            Ok(())
        }
    }
}

/// The warning for a queue with `counts` (`None`: the broker has no such queue yet), if any.
pub(crate) fn unconsumed_warning(
    queue: &str,
    counts: Option<drumline_shared::broker::QueueCounts>,
) -> Option<String> {
    match counts {
        Some(c) if c.consumers > 0 => None,
        _ => Some(format!("warning: no worker consumes queue {queue}")),
    }
}

/// `publish --key K`: warns on stderr when K's run record exists (the copy is a duplicate and
/// will not run). Only told: a Redis that cannot be read does not stop the publish.
pub(crate) async fn warn_recorded(config: &Config, key: &str) {
    let names = Names::new(config.namespace.clone());
    let stamp = async {
        let store = Store::connect(&config.redis_url, config.redis_ca_file.as_deref(), names);
        store.await?.run_stamp(key).await
    };
    let stamp = stamp.await;
    match stamp {
        Ok(Some((state, at))) => eprintln!("{}", recorded_warning(key, &state, at)),
        Ok(None) => {}
        Err(e) => eprintln!("warning: cannot read the run record of key {key}: {e}"),
    }
}

/// `key K already recorded (STATE at T): this copy will not run`; `at` in Unix seconds.
pub(crate) fn recorded_warning(key: &str, state: &str, at: Option<i64>) -> String {
    let when = at
        .and_then(|s| DateTime::<Utc>::from_timestamp(s, 0))
        .map_or_else(
            || "an unknown time".to_owned(),
            drumline_shared::envelope::format_instant,
        );
    format!("key {key} already recorded ({state} at {when}): this copy will not run")
}

/// `pause` (`pause = true`) or `resume`: `jobs`, or every job with `all`; each must be a job
/// of the config (checked before anything changes).
pub(crate) async fn pause(
    config: &Config,
    jobs: &[String],
    all: bool,
    pause: bool,
) -> Result<(), Failure> {
    let names: Vec<&str> = if all {
        config.jobs.iter().map(|j| j.name.as_str()).collect()
    } else {
        jobs.iter()
            .map(|name| Ok(find_job(config, name)?.name.as_str()))
            .collect::<Result<_, Failure>>()?
    };
    let store = store(config).await?;
    let changed = store
        .set_paused(&names, pause)
        .await
        .map_err(|e| Failure::other(format!("redis: {e}")))?;
    let verb = if pause { "paused" } else { "resumed" };
    let already = names.len() as u64 - changed;
    println!(
        "{verb} {} job{} ({changed} changed, {already} already {verb})",
        names.len(),
        if names.len() == 1 { "" } else { "s" }
    );
    Ok(())
}

/// `trigger`: one instance of `job` now, as the job; prints its key.
pub(crate) async fn trigger(
    config: &Config,
    job: &str,
    args: Option<serde_json::Value>,
) -> Result<(), Failure> {
    let job = find_job(config, job)?;
    let env = operate::trigger(job, args, Utc::now());
    // Looked at while publishing, so the trigger stays as quick as the publish.
    let (published, holder) =
        tokio::join!(adhoc::publish(config, &env), overlap_holder(config, job));
    published.map_err(publish_failure)?;
    println!(
        "triggered {} key={} task={} queue={}",
        job.name, env.key, env.task, env.queue
    );
    match holder {
        Ok(holder) => {
            if let Some(warning) = skip_warning(job, holder.as_deref()) {
                eprintln!("{warning}");
            }
        }
        Err(e) => eprintln!(
            "warning: cannot tell whether job {} is running: {e}",
            job.name
        ),
    }
    Ok(())
}

/// How long `trigger` looks for a running instance before it gives up saying so.
const HOLDER_WAIT: std::time::Duration = std::time::Duration::from_millis(800);

/// The instance holding `job`'s overlap lock, for a `skip` job (`None` for others, unread).
async fn overlap_holder(config: &Config, job: &Job) -> Result<Option<String>, String> {
    if job.spec.overlap != Overlap::Skip {
        return Ok(None);
    }
    let names = Names::new(config.namespace.clone());
    let read = async {
        let store = Store::connect(&config.redis_url, config.redis_ca_file.as_deref(), names);
        store.await?.overlap_holder(&job.name).await
    };
    match tokio::time::timeout(HOLDER_WAIT, read).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(_) => Err(format!("redis did not answer within {HOLDER_WAIT:?}")),
    }
}

/// `trigger`'s warning when the copy it publishes will be skipped: the job runs under
/// `overlap = "skip"` and instance `holder` holds its lock (docs/design.md#manual-runs).
pub(crate) fn skip_warning(job: &Job, holder: Option<&str>) -> Option<String> {
    let holder = holder.filter(|_| job.spec.overlap == Overlap::Skip)?;
    Some(format!(
        "warning: job {} (overlap = \"skip\") is running: this trigger will be skipped \
         (running now: {holder})",
        job.name
    ))
}

/// `backfill`: every instant of `job` in `[from, to)`, published with confirms (or listed with
/// `dry_run`); with `wait`, then follows them until each is finished.
pub(crate) async fn backfill(
    config: &Config,
    job: &str,
    (from, to): (&str, &str),
    max: usize,
    (dry_run, wait): (bool, bool),
) -> Result<(), Failure> {
    let job = find_job(config, job)?;
    let range = (instant_arg("--from", from)?, instant_arg("--to", to)?);
    let envelopes = operate::backfill(job, range, max, Utc::now()).map_err(Failure::usage)?;
    if dry_run {
        for env in &envelopes {
            println!("{}", env.key);
        }
        println!("{} instants (dry run: nothing published)", envelopes.len());
        return Ok(());
    }
    let mut publisher = drumline_beat::publisher::Publisher::new(config);
    let outcomes = publisher.publish_batch(&envelopes, 0, || true).await;
    publisher.close().await;
    let outcomes = outcomes.map_err(|e| match e {
        e @ BrokerError::Mismatch { .. } => Failure::usage(e),
        e => Failure::other(e),
    })?;
    let failed = outcomes.iter().filter(|o| o.is_err()).count();
    if let Some(Err(e)) = outcomes.iter().find(|o| o.is_err()) {
        return Err(Failure::other(format!(
            "{failed} of {} instants not confirmed (first: {e}); run the same backfill again:              the confirmed ones are duplicates and will not run twice",
            envelopes.len()
        )));
    }
    println!(
        "backfilled {} instants of {} in [{from}, {to})",
        envelopes.len(),
        job.name
    );
    if wait {
        let keys: Vec<String> = envelopes.into_iter().map(|e| e.key).collect();
        wait_finished(config, &keys).await?;
    }
    Ok(())
}

/// How often `backfill --wait` looks at the instances, and how often it repeats an unchanged
/// count (so a stalled backfill still shows it is waiting).
const WAIT_POLL: std::time::Duration = std::time::Duration::from_millis(250);
const WAIT_REPEAT: std::time::Duration = std::time::Duration::from_secs(10);

/// Prints `N/M done` as the instances `keys` finish (done, dead, or skipped) and returns once
/// every one has (docs/design.md#waiting-copies-wake-up). A backfilled copy never expires.
async fn wait_finished(config: &Config, keys: &[String]) -> Result<(), Failure> {
    let store = store(config).await?;
    let total = keys.len();
    let mut shown: Option<(usize, tokio::time::Instant)> = None;
    loop {
        let states = store.run_states(keys).await.map_err(|e| {
            Failure::other(format!("redis: cannot read the instances' states: {e}"))
        })?;
        let finished = states
            .iter()
            .filter(|s| matches!(s.as_deref(), Some("done" | "dead" | "skipped")))
            .count();
        let repeat = shown.is_some_and(|(_, at)| at.elapsed() >= WAIT_REPEAT);
        if shown.map(|(n, _)| n) != Some(finished) || repeat {
            println!("{finished}/{total} done");
            shown = Some((finished, tokio::time::Instant::now()));
        }
        if finished == total {
            return Ok(());
        }
        tokio::time::sleep(WAIT_POLL).await;
    }
}

/// An RFC 3339 instant given as `flag`.
pub(crate) fn instant_arg(flag: &str, text: &str) -> Result<DateTime<Utc>, Failure> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| Failure::usage(format!("{flag} {text:?} is not an RFC 3339 instant ({e})")))
}

/// A store on the config's Redis, or the failure to say.
pub(crate) async fn store(config: &Config) -> Result<Store, Failure> {
    let names = Names::new(config.namespace.clone());
    Store::connect(&config.redis_url, config.redis_ca_file.as_deref(), names)
        .await
        .map(|store| {
            store
                .with_wait(config.redis_wait)
                .with_journal(config.journal)
        })
        .map_err(store_failure)
}

/// `config` with the schedules and calendars applied at run time, as the leader runs them
/// (docs/design.md#schedules-as-data); those that no longer check are left out.
pub(crate) async fn with_schedules(config: Config) -> Result<Config, Failure> {
    let store = store(&config).await?;
    let with = drumline_beat::dynamic::with_stored(&config, &store).await;
    with.map_err(store_failure)
}

/// A store failure at the edge: a failed connection names Redis and its URL already.
fn store_failure(e: StoreError) -> Failure {
    match e {
        e @ StoreError::Unreachable { .. } => Failure::other(e),
        e => Failure::other(format!("redis: {e}")),
    }
}

/// `publish` and `trigger`: a refused topology is a config problem (exit 2).
fn publish_failure(e: ClientError) -> Failure {
    match e {
        e @ ClientError::Broker(BrokerError::Mismatch { .. }) => Failure::usage(e),
        e if e.is_request() => Failure::usage(e),
        e => Failure::other(e),
    }
}

/// `status`: per-job health read from Redis, for `job` or for every job; the table lists the
/// recent runs with `runs` or for one `job`.
pub(crate) async fn show_status(
    config: &Config,
    job: Option<&str>,
    json: bool,
    runs: bool,
) -> Result<(), Failure> {
    let only = job.map(|name| find_job(config, name)).transpose()?;
    let jobs = only.map_or(&config.jobs[..], std::slice::from_ref);
    let runs = runs || only.is_some();
    let out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    match status::stream(config, jobs, (json, runs), out).await {
        Ok(()) => Ok(()),
        Err(status::StreamError::Store(e)) => Err(store_failure(e)),
        // `status | head`: the reader has what it wanted.
        Err(status::StreamError::Output(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e @ status::StreamError::Output(_)) => Err(Failure::other(e)),
    }
}

/// A command's output on stdout: pretty JSON with `--json`, else the human table.
fn print_output<T: Serialize + ?Sized>(value: &T, json: bool, table: impl Fn(&T) -> String) {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(value).expect("serialisable")
        );
    } else {
        print!("{}", table(value));
    }
}

/// The job named `name`, or a usage failure naming a few of the jobs there are (a config can
/// hold 100,000: name ten, not all).
pub(crate) fn find_job<'c>(config: &'c Config, name: &str) -> Result<&'c Job, Failure> {
    if let Some(job) = config.job(name) {
        return Ok(job);
    }
    const SHOWN: usize = 10;
    let mut known: Vec<String> = config
        .jobs
        .iter()
        .take(SHOWN)
        .map(|j| j.name.clone())
        .collect();
    if config.jobs.len() > SHOWN {
        known.push(format!("… {} more", config.jobs.len() - SHOWN));
    }
    let known = if known.is_empty() {
        "the config has none".to_owned()
    } else {
        format!("jobs: {}", known.join(", "))
    };
    Err(Failure::Usage(format!(
        "{}: no job named {name:?} ({known})",
        config.path.display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_warns_of_a_queue_nobody_consumes_and_of_a_recorded_key() {
        use drumline_shared::broker::QueueCounts;
        let w = |consumers| {
            unconsumed_warning(
                "q",
                Some(QueueCounts {
                    depth: 0,
                    consumers,
                }),
            )
        };
        assert_eq!(w(0).as_deref(), Some("warning: no worker consumes queue q"));
        assert_eq!(w(2), None);
        assert!(unconsumed_warning("q", None).is_some());
        assert_eq!(
            recorded_warning("k", "done", Some(0)),
            "key k already recorded (done at 1970-01-01T00:00:00Z): this copy will not run"
        );
    }

    #[test]
    fn trigger_warns_only_when_a_skip_job_is_running() {
        let job = crate::fixtures::job;
        let skip = job("every = \"1h\"\noverlap = \"skip\"");
        assert_eq!(
            skip_warning(&skip, Some("j@2026-03-02T12:00:00Z")).as_deref(),
            Some(
                "warning: job j (overlap = \"skip\") is running: this trigger will be skipped \
                 (running now: j@2026-03-02T12:00:00Z)"
            )
        );
        assert_eq!(skip_warning(&skip, None), None);
        let queue = job("every = \"1h\"\noverlap = \"queue\"");
        assert_eq!(skip_warning(&queue, Some("j@2026-03-02T12:00:00Z")), None);
    }
}
