//! What every binary's `/metrics` says about itself (feature `bin-support`):
//! `drumline_build_info{version, binary, namespace}` = 1, and the process's CPU time, resident memory and
//! open file descriptors, read from `/proc/self` at each scrape (the Prometheus client
//! libraries' standard `process_*` names, so existing dashboards work).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;

/// Registers `drumline_build_info` for `binary` (`beat`, `worker`) of `namespace` and the
/// process metrics. The namespace is what a dashboard picks its instances by.
pub fn register(registry: &mut Registry, binary: &str, namespace: &str) {
    let info = Family::<Vec<(String, String)>, Gauge>::default();
    info.get_or_create(&vec![
        ("version".to_owned(), env!("CARGO_PKG_VERSION").to_owned()),
        ("binary".to_owned(), binary.to_owned()),
        ("namespace".to_owned(), namespace.to_owned()),
    ])
    .set(1);
    registry.register(
        "drumline_build_info",
        "Always 1; its labels say which drumline version and binary this is",
        info,
    );
    registry.register_collector(Box::new(Process));
}

/// Reads `/proc/self` at each scrape.
#[derive(Debug)]
struct Process;

impl Collector for Process {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .filter(|t| *t > 0)
            .unwrap_or(100) as f64;
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        if let Some(cpu) = cpu_ticks(&stat) {
            let counter = ConstCounter::new(cpu as f64 / ticks);
            let metric = encoder.encode_descriptor(
                "process_cpu_seconds",
                "User and system CPU time spent, in seconds",
                None,
                counter.metric_type(),
            )?;
            counter.encode(metric)?;
        }
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count() as i64);
        let gauges = [
            (
                "process_resident_memory_bytes",
                "Resident memory size, in bytes",
                resident_bytes(&status),
            ),
            ("process_open_fds", "Open file descriptors", fds.ok()),
        ];
        for (name, help, value) in gauges {
            if let Some(value) = value {
                let gauge = ConstGauge::new(value);
                let metric = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
                gauge.encode(metric)?;
            }
        }
        Ok(())
    }
}

/// User + system CPU time in clock ticks, from the text of `/proc/PID/stat` (fields 14 and 15,
/// counted after the command name, which may hold spaces and parentheses).
pub fn cpu_ticks(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace().skip(11);
    let user: u64 = fields.next()?.parse().ok()?;
    let system: u64 = fields.next()?.parse().ok()?;
    Some(user + system)
}

/// Resident memory in bytes, from the `VmRSS:` line of `/proc/PID/status` (in kB).
pub fn resident_bytes(status: &str) -> Option<i64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: i64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    #[test]
    fn proc_files_are_read_past_odd_command_names() {
        let stat = "42 (a b) c) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 9 0 0";
        assert_eq!(cpu_ticks(stat), Some(300));
        assert_eq!(cpu_ticks("garbage"), None);
        let status = "Name:\tx\nVmRSS:\t   2048 kB\nThreads:\t3\n";
        assert_eq!(resident_bytes(status), Some(2048 * 1024));
        assert_eq!(resident_bytes("Name:\tx\n"), None);
    }

    #[test]
    fn build_info_and_process_metrics_are_exposed() {
        let mut registry = Registry::default();
        register(&mut registry, "beat", "billing");
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        let version = env!("CARGO_PKG_VERSION");
        let labels = format!("version=\"{version}\",binary=\"beat\",namespace=\"billing\"");
        let info = format!("drumline_build_info{{{labels}}} 1");
        assert!(text.contains(&info), "{text}");
        for name in [
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_open_fds ",
        ] {
            assert!(text.contains(name), "{name}: {text}");
        }
    }
}
