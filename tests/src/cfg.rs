//! A test's `drumline.toml` written in code, so a test says what it needs and nothing else:
//!
//! ```
//! use drumline_e2e::cfg::{every, shell, Cfg};
//! let toml = Cfg::new()
//!     .set("worker", "lease", "\"3s\"")
//!     .task("slow", shell("sleep 1").with("timeout", "\"10s\""))
//!     .job("slow", every("1s").with("overlap", "\"skip\""))
//!     .toml();
//! assert!(toml.contains("[[jobs]]\nname = \"slow\"\ntask = \"slow\"\nevery = \"1s\""));
//! ```
//!
//! Values are TOML as written (`"\"3s\""`, `"4"`, `"[3]"`); the namespace comes from the
//! [`TestEnv`](crate::TestEnv) that writes the file ([`TestEnv::write_config`](crate::TestEnv::write_config)).

use crate::toml_string;

/// A config under construction: sections, tasks and jobs in the order they were added.
#[derive(Debug, Clone, Default)]
pub struct Cfg {
    sections: Vec<(String, Vec<(String, String)>)>,
    tasks: Vec<(String, Keys)>,
    jobs: Vec<(String, Keys)>,
}

/// The keys of one task or job, in order.
#[derive(Debug, Clone, Default)]
pub struct Keys(Vec<(String, String)>);

impl Keys {
    /// Adds `key = value` (`value` is TOML as written).
    pub fn with(mut self, key: &str, value: &str) -> Self {
        self.0.push((key.to_owned(), value.to_owned()));
        self
    }
}

/// A task that runs `script` with `/bin/sh -c`.
pub fn shell(script: &str) -> Keys {
    let command = format!("[\"/bin/sh\", \"-c\", {}]", toml_string(script));
    Keys::default().with("command", &command)
}

/// A job due every `interval` (`"1s"`).
pub fn every(interval: &str) -> Keys {
    Keys::default().with("every", &toml_string(interval))
}

/// A job due on the cron `expr`.
pub fn cron(expr: &str) -> Keys {
    Keys::default().with("cron", &toml_string(expr))
}

impl Cfg {
    /// An empty config (the namespace is added when it is written).
    pub fn new() -> Self {
        Self::default()
    }

    /// `[section] key = value`.
    pub fn set(mut self, section: &str, key: &str, value: &str) -> Self {
        let entry = (key.to_owned(), value.to_owned());
        match self.sections.iter_mut().find(|(name, _)| name == section) {
            Some((_, keys)) => keys.push(entry),
            None => self.sections.push((section.to_owned(), vec![entry])),
        }
        self
    }

    /// `[tasks.NAME]` with `keys`.
    pub fn task(mut self, name: &str, keys: Keys) -> Self {
        self.tasks.push((name.to_owned(), keys));
        self
    }

    /// A `[[jobs]]` entry named `name`; its task is the task of the same name unless `keys`
    /// set `task`.
    pub fn job(mut self, name: &str, keys: Keys) -> Self {
        self.jobs.push((name.to_owned(), keys));
        self
    }

    /// The TOML text, without the namespace.
    pub fn toml(&self) -> String {
        let mut out = String::new();
        let line = |out: &mut String, (key, value): &(String, String)| {
            out.push_str(&format!("{key} = {value}\n"));
        };
        for (section, keys) in &self.sections {
            out.push_str(&format!("\n[{section}]\n"));
            keys.iter().for_each(|kv| line(&mut out, kv));
        }
        for (name, Keys(keys)) in &self.jobs {
            out.push_str(&format!("\n[[jobs]]\nname = {}\n", toml_string(name)));
            if !keys.iter().any(|(key, _)| key == "task") {
                out.push_str(&format!("task = {}\n", toml_string(name)));
            }
            keys.iter().for_each(|kv| line(&mut out, kv));
        }
        for (name, Keys(keys)) in &self.tasks {
            out.push_str(&format!("\n[tasks.{name}]\n"));
            keys.iter().for_each(|kv| line(&mut out, kv));
        }
        out
    }
}

/// Shorthands for the sections the end-to-end tests set most.
impl Cfg {
    /// `[worker] concurrency = N` and `lease = "LEASE"`.
    pub fn worker_slots(self, concurrency: u32, lease: &str) -> Self {
        self.set("worker", "concurrency", &concurrency.to_string())
            .set("worker", "lease", &toml_string(lease))
    }

    /// `[redis] url = "URL"`.
    pub fn redis_url(self, url: &str) -> Self {
        self.set("redis", "url", &toml_string(url))
    }

    /// `[broker] url = "URL"`.
    pub fn broker_url(self, url: &str) -> Self {
        self.set("broker", "url", &toml_string(url))
    }

    /// One `[[jobs]]` entry per (name, keys), each running task `task`.
    pub fn jobs_of(self, task: &str, jobs: Vec<(&str, Keys)>) -> Self {
        let task = toml_string(task);
        jobs.into_iter().fold(self, |cfg, (name, keys)| {
            cfg.job(name, keys.with("task", &task))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use drumline_shared::config::Config;
    use std::path::Path;

    /// What the builder writes is a config drumline itself accepts, with every key in place.
    #[test]
    fn the_builder_writes_a_config_drumline_accepts() {
        let text = Cfg::new()
            .set("worker", "concurrency", "4")
            .set("worker", "lease", "\"3s\"")
            .task(
                "slow",
                shell("echo \"$DRUMLINE_KEY\"").with("max_retries", "1"),
            )
            .job("slow", every("1s").with("overlap", "\"queue\""))
            .job("nightly", cron("30 2 * * *").with("task", "\"slow\""))
            .toml();
        let text = format!("namespace = \"t_cfg\"\n{text}");
        let config = Config::parse(&text, Path::new("cfg.toml"), |_| None)
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(config.worker.concurrency, 4);
        assert_eq!(config.worker.lease.as_secs(), 3);
        assert_eq!(config.jobs.len(), 2);
        assert_eq!(&*config.jobs[1].spec.task, "slow");
        assert_eq!(config.tasks["slow"].max_retries, 1);
        assert_eq!(
            config.tasks["slow"].command.as_deref(),
            Some(
                &[
                    "/bin/sh".to_owned(),
                    "-c".into(),
                    "echo \"$DRUMLINE_KEY\"".into()
                ][..]
            )
        );
    }
}
