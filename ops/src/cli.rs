//! The beat's operator commands as a clap [`Command`] enum and their dispatch
//! ([`Command::run`]): `drumline-beat` and the one `drumline` command both flatten this enum, so
//! a command added here appears in both (docs/design.md#one-command-for-operators).

use crate::{adhoc, commands, prove, schedules};
use clap::Subcommand;
use drumline_shared::config::Config;
use drumline_shared::exit::Failure;
use drumline_shared::store::ObjectKind;
use std::path::Path;

/// The beat's operator commands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Validate the config and exit (0 when valid, 2 with one clear message when not).
    Check,
    /// Show upcoming instants, UTC and local, with DST gap/fold annotations.
    Next {
        /// Only this job.
        job: Option<String>,
        /// How many instants per job.
        #[arg(long, default_value_t = 10)]
        count: usize,
        /// Start strictly after this instant (RFC 3339) [default: now].
        #[arg(long)]
        from: Option<String>,
        /// Machine-readable output: [{job, utc, runs_at, local, offset, note}].
        #[arg(long)]
        json: bool,
    },
    /// Publish one ad-hoc task (same envelope and guarantees as a scheduled instance).
    ///
    /// With `TRACEPARENT` set (a W3C trace context), the task runs in that trace.
    Publish {
        /// Task name (a [tasks.NAME] entry).
        task: String,
        /// Arguments as a JSON value, handed to the task.
        #[arg(long, default_value = "{}")]
        args: String,
        /// Idempotency key [default: a fresh UUID]; publishing the same key twice runs it once.
        #[arg(long)]
        key: Option<String>,
        /// Due this long after now (e.g. "30s"); waits in a delay queue meanwhile, and is not
        /// started sooner (`not_before`).
        #[arg(long, value_parser = parse_duration, default_value = "0s")]
        delay: std::time::Duration,
        /// Not started before this instant (RFC 3339), instead of --delay.
        #[arg(long, value_parser = parse_rfc3339, conflicts_with = "delay")]
        not_before: Option<chrono::DateTime<chrono::Utc>>,
        /// Not run after this long past the due instant (e.g. "10m").
        #[arg(long, value_parser = parse_duration)]
        expires: Option<std::time::Duration>,
        /// Not run after this instant (RFC 3339, after the due instant), instead of --expires.
        #[arg(long, value_parser = parse_rfc3339, conflicts_with = "expires")]
        expires_at: Option<chrono::DateTime<chrono::Utc>>,
        /// Logical queue [default: default].
        #[arg(long)]
        queue: Option<String>,
    },
    /// Pause jobs: the leader publishes none of their instants (dropped, counted, never caught
    /// up) until `resume`.
    Pause {
        /// Jobs to pause.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        jobs: Vec<String>,
        /// Every job of the config.
        #[arg(long)]
        all: bool,
    },
    /// Resume paused jobs: their next instants are published; the paused ones never are.
    Resume {
        /// Jobs to resume.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        jobs: Vec<String>,
        /// Every job of the config.
        #[arg(long)]
        all: bool,
    },
    /// Publish one instance of a job now, as the job (task, queue, args, overlap, history).
    Trigger {
        /// The job.
        job: String,
        /// Arguments as a JSON value, instead of the job's.
        #[arg(long)]
        args: Option<String>,
    },
    /// Publish every instant of a job's schedule in [--from, --to), oldest first.
    Backfill {
        /// The job.
        job: String,
        /// First instant considered (RFC 3339), included.
        #[arg(long)]
        from: String,
        /// End of the range (RFC 3339), excluded; not in the future.
        #[arg(long)]
        to: String,
        /// List the instants without publishing.
        #[arg(long)]
        dry_run: bool,
        /// Then print `N/M done` as the instants finish, and exit when all have.
        #[arg(long, conflicts_with = "dry_run")]
        wait: bool,
        /// Refuse a range with more instants than this.
        #[arg(long, default_value_t = crate::operate::DEFAULT_BACKFILL_MAX)]
        max: usize,
    },
    /// Per job: schedule, next due, last published, last success/failure, running now, paused,
    /// stale; with JOB or `--runs`, its recent runs (outcome, duration, error).
    Status {
        /// Only this job, with its recent runs.
        job: Option<String>,
        /// Machine-readable output: {leader, dead_letters, jobs: [...]}; every job carries its
        /// recent runs.
        #[arg(long)]
        json: bool,
        /// Also list each job's recent runs under the table (implied by JOB).
        #[arg(long)]
        runs: bool,
    },
    /// A job's expected instants and what became of each (ran, retried, dead, skipped,
    /// expired, pending, MISSED, DOUBLED), from the journal and the run records.
    Audit {
        /// The job.
        job: String,
        /// First instant (RFC 3339) [default: 24 h before --to].
        #[arg(long)]
        from: Option<String>,
        /// Last instant (RFC 3339) [default: now].
        #[arg(long)]
        to: Option<String>,
        /// Machine-readable output: {job, from, to, instants: [...]}.
        #[arg(long)]
        json: bool,
    },
    /// Check every instance and ad-hoc key of the window against the promise: exit 0 when it
    /// holds, 1 with each violation (key, rule, evidence).
    Verify {
        /// How far back (e.g. "1h", "30m").
        #[arg(long, value_parser = parse_duration, default_value = "1h")]
        since: std::time::Duration,
        /// How long after its instant a published instance without `expires` (or a failed
        /// attempt's retry) may go without an end before it counts as `lost`
        /// (`retry_dropped`).
        #[arg(long, value_parser = parse_duration, default_value = "15m")]
        overdue: std::time::Duration,
        /// Machine-readable output: {since, checked, holds, violations: [...]}.
        #[arg(long)]
        json: bool,
    },
    /// Jobs created, changed and removed at run time, stored in Redis (no file edit, no
    /// reload): apply, get, list, delete.
    Schedules {
        /// What to do.
        #[command(subcommand)]
        action: SchedulesCommand,
    },
    /// What became of one key, scheduled or ad hoc: state, attempt, fencing token, worker,
    /// error, dead letter and its journal entries (exit 1 when drumline has no trace of it).
    Inspect {
        /// The idempotency key.
        key: String,
        /// Machine-readable output: {key, state, attempt, fencing_token, worker, updated_at,
        /// error, dead_letter, journal}.
        #[arg(long)]
        json: bool,
    },
    /// Calendars (dates jobs skip) created, changed and removed at run time: apply
    /// `{"name", "dates"}` objects, get, list, delete. The file's cannot be replaced.
    Calendars {
        /// What to do.
        #[command(subcommand)]
        action: SchedulesCommand,
    },
}

/// `drumline schedules …`.
#[derive(Subcommand, Debug)]
pub enum SchedulesCommand {
    /// Create or replace schedules from a JSON object or array (FILE, or stdin with `-` or
    /// none), all or nothing; prints `created|replaced|unchanged NAME` per object.
    Apply {
        /// The JSON file [default: stdin].
        file: Option<std::path::PathBuf>,
    },
    /// Show one schedule (exit 1 when there is none).
    Get {
        /// Its name.
        name: String,
        /// Machine-readable output: the object with source, created_at, updated_at, next.
        #[arg(long)]
        json: bool,
    },
    /// List the config's jobs and the stored schedules.
    List {
        /// Only those with this label (K=V; repeat for all of several).
        #[arg(long = "label", value_parser = schedules::parse_label)]
        labels: Vec<(String, String)>,
        /// Machine-readable output: {schedules: [...], next_cursor}.
        #[arg(long)]
        json: bool,
    },
    /// Delete schedules: they publish nothing more (runs in flight finish).
    Delete {
        /// Their names.
        #[arg(required = true)]
        names: Vec<String>,
    },
}

impl SchedulesCommand {
    async fn run(self, config: &Config, kind: ObjectKind) -> Result<(), Failure> {
        let store = &commands::store(config).await?;
        match self {
            SchedulesCommand::Apply { file } => {
                schedules::apply(config, store, kind, file.as_deref()).await
            }
            SchedulesCommand::Get { name, json } => {
                schedules::get(config, store, (kind, &name), json).await
            }
            SchedulesCommand::List { labels, json } => {
                schedules::list(config, store, (kind, &labels), json).await
            }
            SchedulesCommand::Delete { names } => schedules::delete(store, kind, &names).await,
        }
    }
}

/// `--delay`, `--expires`: a duration like `30s` or `10m`.
pub(crate) fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    drumline_shared::duration::parse(text)
}

/// `--not-before`, `--expires-at`: an RFC 3339 instant.
fn parse_rfc3339(text: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    drumline_shared::envelope::parse_instant(text)
        .ok_or_else(|| format!("{text:?} is not an RFC 3339 instant"))
}

impl Command {
    /// Whether the command reads Redis anyway: it then sees the schedules applied at run time
    /// as jobs.
    fn reads_redis(&self) -> bool {
        matches!(
            self,
            Command::Pause { .. }
                | Command::Resume { .. }
                | Command::Trigger { .. }
                | Command::Backfill { .. }
                | Command::Status { .. }
                | Command::Audit { .. }
                | Command::Verify { .. }
        )
    }

    /// `publish`.
    async fn publish(self, config: &Config) -> Result<(), Failure> {
        let Command::Publish {
            task,
            args,
            key,
            delay,
            not_before,
            expires,
            expires_at,
            queue,
        } = self
        else {
            return Ok(());
        };
        let args = commands::json_args(&args)?;
        let request = adhoc::Request {
            task,
            args,
            key,
            delay,
            not_before,
            expires,
            expires_at,
            queue,
        };
        commands::publish(config, &request).await
    }

    /// The commands on what Redis holds by name: schedules, calendars, one key.
    async fn run_stored(self, config: &Config) -> Result<(), Failure> {
        match self {
            Command::Schedules { action } => action.run(config, ObjectKind::Schedule).await,
            Command::Calendars { action } => action.run(config, ObjectKind::Calendar).await,
            Command::Inspect { key, json } => {
                crate::inspect::inspect(&commands::store(config).await?, &key, json).await
            }
            _ => Ok(()),
        }
    }

    /// `config`, and the schedules applied at run time when [`Command::reads_redis`].
    async fn with_schedules(&self, config: Config) -> Result<Config, Failure> {
        match self.reads_redis() {
            true => commands::with_schedules(config).await,
            false => Ok(config),
        }
    }

    /// Runs the command on `config`, loaded from `path`.
    pub async fn run(self, config: Config, path: &Path) -> Result<(), Failure> {
        let config = self.with_schedules(config).await?;
        match self {
            Command::Check => commands::check(path, &config),
            Command::Next {
                job,
                count,
                from,
                json,
            } => commands::show_next(&config, job.as_deref(), count, from.as_deref(), json),
            publish @ Command::Publish { .. } => publish.publish(&config).await,
            Command::Pause { jobs, all } => commands::pause(&config, &jobs, all, true).await,
            Command::Resume { jobs, all } => commands::pause(&config, &jobs, all, false).await,
            Command::Trigger { job, args } => {
                let args = args.as_deref().map(commands::json_args).transpose()?;
                commands::trigger(&config, &job, args).await
            }
            Command::Backfill {
                job,
                from,
                to,
                dry_run,
                wait,
                max,
            } => commands::backfill(&config, &job, (&from, &to), max, (dry_run, wait)).await,
            Command::Status { job, json, runs } => {
                commands::show_status(&config, job.as_deref(), json, runs).await
            }
            Command::Audit {
                job,
                from,
                to,
                json,
            } => prove::audit(&config, &job, (from.as_deref(), to.as_deref()), json).await,
            Command::Verify {
                since,
                overdue,
                json,
            } => prove::verify(&config, (since, overdue), json).await,
            stored @ (Command::Schedules { .. }
            | Command::Calendars { .. }
            | Command::Inspect { .. }) => stored.run_stored(&config).await,
        }
    }
}
